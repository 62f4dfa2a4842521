"""Building and running a pipeline from Python: presets, a plain generator as the prompt
stream, the Trainer's loss_fn/optimizer, and what checkpoints and resumes do with a stream
that cannot save its position.

A generator-driven run trains the generator's problems in order and checkpoints everything
but the stream's position (the params are restored and compared); resuming it is refused in
one line from Python and with exit code 2 from launch.py, before anything loads, and so is
resuming a grain-stream checkpoint with a generator. A finite stream is enough when it covers
every step, and says how short it fell when it does not.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from pipelinerl_jax import pipeline, presets
from pipelinerl_jax.data.tasks import make_task
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import components
from pipelinerl_jax.pipeline.coordinator import PipelineError
from pipelinerl_jax.train.checkpoint import RunCheckpointer
from pipelinerl_jax.train.pytree_dicts import as_abstract

ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(log_every=0, eval_every=0)


def problems(seed: int):
    """An endless generator of the tiny preset's task problems, in a seeded random order."""
    task = make_task("reverse_digits", min_digits=2, max_digits=5)
    rng = random.Random(seed)
    while True:
        yield task.problem(rng.randrange(task.num_problems))


def _trained_prompts(workdir) -> list[list[str]]:
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r["prompts"] for r in map(json.loads, lines) if r["kind"] == "train"]


def _launch(*flags):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--config=configs/tiny.py", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_a_generator_run_checkpoints_all_but_the_stream_and_refuses_to_resume(tmp_path):
    seed = random.Random().randrange(1 << 16)
    cfg = presets.tiny(steps=3, checkpoint_every=2, seed=seed, **QUIET)
    c = pipeline.build(cfg, prompts=problems(seed))
    lines = []
    summary = pipeline.run(cfg, str(tmp_path), components=c, echo=lines.append)
    assert summary["steps"] == 3
    assert any("has no get_state/set_state" in line for line in lines)
    draw = problems(seed)
    g = cfg.groups_per_step
    expected = [next(draw).uid for _ in range(3 * g)]
    assert _trained_prompts(tmp_path) == [expected[s * g : (s + 1) * g] for s in range(3)]

    # Checkpoints at step 2 and at the end hold everything but the stream's position.
    ckpt = RunCheckpointer(tmp_path, read_only=True)
    try:
        assert ckpt.steps() == [2, 3]
        extra = ckpt.read_json(3, "extra")
        assert extra["data"] is None and extra["step"] == 3
        assert extra["config"]["seed"] == seed and isinstance(extra["pending"], list)
        params = ckpt.restore_params(3, as_abstract(c.state.params))
    finally:
        ckpt.close()
    jax.tree.map(np.testing.assert_array_equal, params, c.state.params)

    # Relaunching the finished run is not a resume: it says so and trains nothing.
    again = pipeline.run(cfg, str(tmp_path), prompts=problems(seed), echo=lines.append)
    assert again == {"finished_at": 3}
    # Training it further would need the stream's position: refused before anything loads.
    config_json = (tmp_path / "config.json").read_text()
    longer = presets.tiny(steps=5, checkpoint_every=2, seed=seed, **QUIET)
    for prompts in (problems(seed), None):
        with pytest.raises(ConfigError, match="cannot resume from the checkpoint at step 3") as e:
            pipeline.run(longer, str(tmp_path), prompts=prompts, echo=lines.append)
        assert "holds no stream position" in str(e.value) and "\n" not in str(e.value)
    assert (tmp_path / "config.json").read_text() == config_json
    # The same from the command line: one line on stderr, exit code 2.
    proc = _launch(
        f"--workdir={tmp_path}",
        "--config.steps=5",
        "--config.checkpoint_every=2",
        f"--config.seed={seed}",
        "--config.log_every=0",
        "--config.eval_every=0",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("config error: cannot resume from the checkpoint at step 3")
    assert proc.stderr.count("\n") == 1 and "get_state/set_state" in proc.stderr


def test_resuming_a_grain_stream_checkpoint_with_a_generator_is_refused(tmp_path):
    seed = random.Random().randrange(1 << 16)
    cfg = presets.tiny(steps=2, checkpoint_every=1, seed=seed, **QUIET)
    assert pipeline.run(cfg, str(tmp_path), echo=lambda *_: None)["steps"] == 2
    longer = presets.tiny(steps=4, checkpoint_every=1, seed=seed, **QUIET)
    with pytest.raises(ConfigError) as e:
        pipeline.run(longer, str(tmp_path), prompts=problems(seed), echo=lambda *_: None)
    message = str(e.value)
    assert message.startswith("cannot resume from the checkpoint at step 2: the prompt stream")
    assert "(generator) has no get_state/set_state" in message and "\n" not in message
    assert "PromptStream" in message  # names a stream that can


@pytest.mark.parametrize("short", [0, 1])
def test_a_finite_stream_must_cover_every_step(tmp_path, short):
    seed = random.Random().randrange(1 << 16)
    cfg = presets.tiny(steps=2, max_lag=2, seed=seed, **QUIET)
    needed = cfg.steps * cfg.groups_per_step
    stream = problems(seed)
    prompts = [next(stream) for _ in range(needed - short)]  # a list: any iterable works
    if short:
        with pytest.raises(PipelineError, match=f"prompt stream ended after {needed - 1} prompts"):
            pipeline.run(cfg, None, prompts=prompts, echo=lambda *_: None)
        return
    # max_lag 2 lets admission start groups past the last step; running dry there is fine.
    assert pipeline.run(cfg, str(tmp_path), prompts=prompts, echo=lambda *_: None)["steps"] == 2
    g = cfg.groups_per_step
    uids = [p.uid for p in prompts]
    assert _trained_prompts(tmp_path) == [uids[:g], uids[g:]]


def test_a_stream_of_something_else_than_problems_fails_in_one_line():
    cfg = presets.tiny(steps=1, **QUIET)
    with pytest.raises(PipelineError, match="the prompt stream yielded a str; it must yield"):
        pipeline.run(cfg, None, prompts=iter(["12345="] * 100), echo=lambda *_: None)


class _Stop(Exception):
    pass


def test_loss_fn_and_optimizer_reach_the_trainer_only_when_given(monkeypatch):
    seen = []

    def recording_trainer(*args, **kwargs):
        seen.append(kwargs)
        raise _Stop  # the keywords are all this test needs

    monkeypatch.setattr(components, "Trainer", recording_trainer)
    cfg = presets.tiny(**QUIET)
    loss_fn, optimizer = object(), object()
    for kwargs in ({}, {"loss_fn": loss_fn}, {"optimizer": optimizer}):
        with pytest.raises(_Stop):
            pipeline.build(cfg, **kwargs)
    with pytest.raises(_Stop):
        pipeline.run(cfg, None, loss_fn=loss_fn, optimizer=optimizer, echo=lambda *_: None)
    assert seen == [
        {},
        {"loss_fn": loss_fn},
        {"optimizer": optimizer},
        {"loss_fn": loss_fn, "optimizer": optimizer},
    ]


def test_components_and_build_arguments_do_not_mix():
    cfg = presets.tiny(**QUIET)
    with pytest.raises(ConfigError, match=r"pass prompts, optimizer to build\(\) instead"):
        pipeline.run(cfg, components=object(), prompts=[], optimizer=object())


def test_prompts_that_are_not_iterable_are_a_config_error():
    with pytest.raises(ConfigError, match="prompts: int is not iterable"):
        pipeline.run(presets.tiny(**QUIET), None, prompts=3)


def test_a_bad_reward_function_stops_the_run_before_its_checkpointer(tmp_path):
    """A reward function that cannot be imported is a ConfigError before the run makes its
    checkpointer (which creates checkpoints/ and starts Orbax's thread): an exit with that
    thread still at work printed its traceback after the one-line error."""
    import dataclasses

    cfg = presets.tiny(steps=1, checkpoint_every=1, **QUIET)
    cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, fn="no_such_module:fn"))
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        pipeline.run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()
