"""pipelinerl_jax.presets: the configs/*.py files' values, importable from the installed
package, with Python overrides that behave as launch.py's --config.<field> flags do."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl_jax import config_cli, presets
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.pipeline import config_dict

ROOT = Path(__file__).resolve().parents[1]
FILES = {
    "demo": "default.py",
    "tiny": "tiny.py",
    "guess": "guess.py",
    "smollm2_math": "smollm2_math.py",
    "smollm2_calculator": "smollm2_calculator.py",
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_preset_is_its_config_file(name):
    from_file = config_dict.from_config_dict(
        config_cli.load_file(str(ROOT / "configs" / FILES[name]))
    )
    preset = getattr(presets, name)()
    assert config_lib.as_dict(preset) == config_lib.as_dict(from_file)
    assert (
        presets.PRESETS[name]().to_dict()
        == config_cli.load_file(str(ROOT / "configs" / FILES[name])).to_dict()
    )


def test_overrides_match_the_command_line():
    rng = random.Random()
    steps, lr, layers = rng.randrange(2, 50), rng.uniform(1e-4, 1e-2), rng.randrange(1, 4)
    lag, shuffle = rng.randrange(0, 4), rng.randrange(0, 100)
    cfg = presets.tiny(
        steps=steps,
        max_lag=lag,
        trainer=dict(learning_rate=lr),
        data=dict(shuffle_seed=shuffle, task_options={"min_digits": 3, "max_digits": 4}),
        **{"model.init.num_layers": layers, "sampler.num_pages": 40},
    )
    rest, overrides = config_cli.split_argv(
        [
            f"--config.steps={steps}",
            f"--config.max_lag={lag}",
            f"--config.trainer.learning_rate={lr!r}",
            f"--config.data.shuffle_seed={shuffle}",
            '--config.data.task_options={"min_digits": 3, "max_digits": 4}',
            f"--config.model.init.num_layers={layers}",
            "--config.sampler.num_pages=40",
        ]
    )
    c = config_cli.load_file(str(ROOT / "configs" / "tiny.py"))
    config_cli.apply_overrides(c, overrides)
    assert rest == [] and config_lib.as_dict(cfg) == config_lib.as_dict(
        config_dict.from_config_dict(c)
    )
    # What the overrides reached, and what they left alone.
    assert cfg.trainer.total_steps == steps  # derived from steps after the override
    assert cfg.trainer.learning_rate == lr and cfg.trainer.grad_clip_norm == 1.0
    assert dict(cfg.data.task_options) == {"min_digits": 3, "max_digits": 4}
    assert dict(cfg.model.init)["num_layers"] == layers
    assert dict(cfg.model.init)["hidden_size"] == 32  # the other init keys stay tiny's


def test_run_config_leaves_the_callers_config_dict_alone():
    c = presets.demo_config()
    before = c.to_dict()
    cfg = presets.run_config(c, steps=3, batch=dict(normalize_std=True))
    assert cfg.steps == 3 and cfg.batch.normalize_std is True
    assert c.to_dict() == before


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_lagg=3), "config.max_lagg: no such field; did you mean max_lag?"),
        (dict(trainer=dict(learning_rat=1.0)), "did you mean learning_rate?"),
        ({"model.init.num_layerz": 3}, "no such ModelConfig field; did you mean num_layers?"),
        (dict(batch_size=30), "not divisible by config.group_size"),
    ],
)
def test_bad_overrides_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        presets.tiny(**overrides)
    assert "\n" not in str(e.value)


def test_presets_need_no_configs_folder(tmp_path):
    code = (
        "import sys; from pipelinerl_jax import pipeline, presets; "
        "cfg = presets.smollm2_math(steps=2); "
        "assert 'configs' not in sys.modules and callable(pipeline.run); "
        "print(cfg.steps, cfg.model.hf_dir)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "models/SmolLM2-135M-Instruct"]
