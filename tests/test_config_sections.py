"""The config dataclasses check themselves when built, not only through from_config_dict: each
section its own fields, RunConfig how the sections fit together, with the one-line errors a
config file gets."""

import dataclasses
import re

import pytest

from pipelinerl_jax import presets
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.sampler.config import SamplerConfig


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: config_lib.ModelSpec(), "config.model: set model.hf_dir"),
        (
            lambda: config_lib.ModelSpec(hf_dir="m", remat_policy="matmuls"),
            "set config.model.remat=True too",
        ),
        (
            lambda: config_lib.ModelSpec(init=(("num_layerz", 2),)),
            "config.model.init.num_layerz: no such ModelConfig field; did you mean num_layers?",
        ),
        (lambda: config_lib.DataSpec(task=""), "config.data: set data.task"),
        (
            # The default task would be trained and the files never read.
            lambda: config_lib.DataSpec(datasets=({"path": "train.jsonl", "format": "gsm8k"},)),
            "data.task='reverse_digits' and data.datasets are both set",
        ),
        (lambda: config_lib.DataSpec(task="sorting"), "config.data.task='sorting' is unknown"),
        (
            lambda: config_lib.DataSpec(task_options=(("difficulty", 2),)),
            "task reverse_digits has no such option",
        ),
        (lambda: config_lib.RewardSpec(table="nosuch"), "unknown reward table 'nosuch'"),
        (lambda: config_lib.DeviceSpec(trainer_tp=0), "devices.trainer_tp=0 and"),
        (lambda: SamplerConfig(attention="flash"), "sampler attention='flash'"),
    ],
)
def test_a_section_checks_its_own_fields(build, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        build()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(batch_size=30), "config.batch_size=30 is not divisible by config.group_size=4"),
        (dict(steps=0), "config.steps=0 must be >= 1"),
        (dict(max_new_tokens=24), "max_new_tokens=24 exceed sampler.max_seq_len=24"),
        (dict(group_size=32, batch_size=32), "config.group_size=32 exceeds sampler.num_slots=16"),
        (dict(temperature=0.5), "loss.temperature=1.0 differs from generation.temperature=0.5"),
        (dict(eval_every=-1), "config.eval_every=-1 must be >= 0"),
        (
            dict(data=config_lib.DataSpec(task="", datasets=("x.jsonl",))),
            "config.eval_every needs eval.datasets",
        ),
    ],
)
def test_run_config_checks_its_fields_and_how_the_sections_fit(change, message):
    cfg = presets.tiny()
    with pytest.raises(ConfigError, match=re.escape(message)):
        dataclasses.replace(cfg, **change)
