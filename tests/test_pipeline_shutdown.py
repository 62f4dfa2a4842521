"""Faults end a run cleanly and quickly: a raising reward, a trainer exception, Ctrl-C, and
bad configuration (exit 2 before anything compiles)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_pipeline_run import FakeState, ScriptedTrainer, tiny_config

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import components as build_lib
from pipelinerl_jax.pipeline import runner as run_lib
from pipelinerl_jax.pipeline.coordinator import PipelineError

ROOT = Path(__file__).resolve().parents[1]


def raising_reward(completion, problem):
    raise RuntimeError("reward bug")


def test_raising_reward_scores_zero_and_the_run_continues():
    cfg = tiny_config(steps=3, **{"reward.fn": "test_pipeline_shutdown:raising_reward"})
    components = build_lib.build(cfg)
    params = components.state.params
    components.trainer, components.state = ScriptedTrainer(params, params), FakeState(params)
    summary = run_lib.run(cfg, None, components=components, echo=lambda *_: None)
    assert summary["steps"] == 3
    assert summary["reward/first20"] == 0.0


class ExplodingTrainer(ScriptedTrainer):
    def train_step(self, state, batch):
        if len(self.batches) == 1:
            raise FloatingPointError("boom in the train step")
        return super().train_step(state, batch)


def test_trainer_exception_stops_both_threads_and_names_its_origin():
    cfg = tiny_config(steps=50)
    components = build_lib.build(cfg)
    params = components.state.params
    components.trainer, components.state = ExplodingTrainer(params, params), FakeState(params)
    t0 = time.perf_counter()
    with pytest.raises(PipelineError, match="trainer thread failed: FloatingPointError: boom"):
        run_lib.run(cfg, None, components=components, echo=lambda *_: None)
    assert time.perf_counter() - t0 < 60


def _launch(*flags, **popen):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), *flags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def test_ctrl_c_ends_the_run_within_seconds_and_leaves_no_process(tmp_path):
    proc = _launch(
        "--config.steps=100000",
        "--config.log_every=1",
        "--config.reward.workers=2",
        f"--workdir={tmp_path}",
        start_new_session=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.time() < deadline, "run never reached step 2"
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    t0 = time.time()
    _, err = proc.communicate(timeout=30)
    assert time.time() - t0 < 30
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err
    # Nothing of the run's process group (reward workers, their fork server) survives it.
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    left = subprocess.run(
        ["ps", "-o", "pid,stat,cmd", "-g", str(proc.pid)], capture_output=True, text=True
    ).stdout
    raise AssertionError(f"processes outlived the run:\n{left}")


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(batch_size=30), "not divisible by config.group_size"),
        ({"data.task": "sorting"}, "unknown"),
        (dict(mode="async"), "config.mode"),
        (dict(max_lag=-1), "max_lag"),
        ({"generation.max_new_tokens": 64}, "exceed sampler.max_seq_len"),
        ({"loss.temperature": 0.5}, "loss.temperature"),
        ({"trainer.learning_rat": 1.0}, "unknown field"),
    ],
)
def test_bad_config_is_one_line_config_error(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        tiny_config(**override)
    assert "\n" not in str(info.value)


def test_more_sampler_devices_than_exist_is_refused():
    cfg = tiny_config(**{"devices.sampler": 9})
    with pytest.raises(ConfigError, match="devices.sampler=9"):
        build_lib.split_devices(list(range(4)), cfg.devices)
    halves = build_lib.split_devices(list(range(8)), tiny_config().devices)
    assert [len(x) for x in halves] == [4, 4]


def test_sampler_tp_that_does_not_divide_is_refused():
    cfg = tiny_config(**{"devices.sampler": 3, "devices.sampler_tp": 2})
    with pytest.raises(ConfigError, match="sampler_tp=2 does not divide the 3 sampler"):
        build_lib.split_devices(list(range(8)), cfg.devices)
    cfg = tiny_config(**{"devices.sampler_tp": 2})
    with pytest.raises(ConfigError, match="sampler_tp=2"):
        build_lib.split_devices(list(range(1)), cfg.devices)
    with pytest.raises(ConfigError, match="sampler_tp=0"):
        tiny_config(**{"devices.sampler_tp": 0})


def test_launch_exits_2_on_bad_config():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--config.batch_size=30"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("config error:") and "group_size" in last
