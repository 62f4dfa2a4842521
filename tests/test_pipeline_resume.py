"""Kill -9 a run at a seeded random point, resume it from its workdir: nothing lost, nothing twice.

Conventional mode with a fixed seed is deterministic, so the resumed run's per-step losses
must equal an uninterrupted run's, and the prompts trained at each step must be the same.
Pipeline mode (the default) is not: weights land in the sampler whenever the trainer
publishes them, so losses differ from run to run. What it guarantees is the data: steps train
groups in start order, so step s trains the stream's problems s*g .. s*g + g - 1 as an
uninterrupted run does, every prompt of the stream's first steps x g is trained exactly once,
and the groups in flight or scored-but-untrained at the checkpoint are carried over
(regenerated, or trained as saved). test_pipeline_resume_episodes.py checks the same of
multi-turn episodes killed between two turns.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAGS = [
    "--config=configs/tiny.py",
    "--config.mode=conventional",
    "--config.conventional_steps=2",
    "--config.steps=6",
    "--config.checkpoint_every=2",
    "--config.eval_every=0",  # the end-of-run evaluation tests nothing here and costs seconds
]


PIPELINE_FLAGS = [
    "--config=configs/tiny.py",
    "--config.max_lag=3",
    "--config.steps=10",
    "--config.checkpoint_every=2",
    "--config.checkpoint_keep=8",
    "--config.reward.fn=tests.test_pipeline_resume:uneven_reward",
    "--config.eval_every=0",
]
KILL_SEED = 20261125  # the kill points are drawn from this seed (printed on failure)


def uneven_reward(completion: str, problem):
    """The task's reward, 0.1 s late for half the problems (by a hash of their uid) and at once
    for the rest: later groups are then scored while earlier ones still wait, so checkpoints
    find both scored-but-untrained groups and groups still in flight. (0.1 s, not 0.3 s: an
    uninterrupted run took 19 s instead of 40 s, and its checkpoints at steps 4 and 6 held
    both kinds at either delay, in every run measured.)"""
    import zlib

    from pipelinerl_jax.rewards.tables import task_reward

    if zlib.crc32(problem.uid.encode()) % 2 == 0:
        time.sleep(0.1)
    return task_reward(completion, problem)


def launch(workdir, *extra, wait=True, flags=FLAGS):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(ROOT / "launch.py"), *flags, f"--workdir={workdir}", *extra]
    if wait:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def train_records(workdir):
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(l) for l in lines if '"kind": "train"' in l]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The workdir of an uninterrupted conventional run of FLAGS (6 steps, checkpoints every
    2): what the kill -9 test must reproduce, and a finished run to relaunch with another model
    shape (one launch for both: a launch is seconds of start-up and compilation)."""
    full = tmp_path_factory.mktemp("full")
    ref = launch(full)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return full


def test_kill_9_then_resume_continues_exactly(tmp_path, uninterrupted):
    killed = tmp_path / "killed"
    ref_records = {r["step"]: r for r in train_records(uninterrupted)}
    assert sorted(ref_records) == list(range(6))

    kill_after = random.Random(KILL_SEED).choice([3, 4, 5])  # a point past a checkpoint
    kill_after_checkpoint(launch(killed, wait=False), killed, kill_after)

    resumed = launch(killed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step" in resumed.stdout
    records = train_records(killed)
    # The killed run logged some steps, the resumed one re-did the steps after its
    # checkpoint: keep the last record of each step.
    by_step = {r["step"]: r for r in records}
    assert sorted(by_step) == list(range(6))
    for step in range(6):
        assert by_step[step]["prompts"] == ref_records[step]["prompts"], step
        np.testing.assert_allclose(
            by_step[step]["loss"], ref_records[step]["loss"], rtol=1e-5, atol=1e-7
        )
    trained = [uid for s in range(6) for uid in by_step[s]["prompts"]]
    assert len(trained) == len(set(trained))  # no prompt trained twice


def kill_after_checkpoint(proc, workdir, kill_after: int) -> None:
    """SIGKILLs the run's process group once a checkpoint is finished and `kill_after` steps
    are logged."""
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, f"no checkpoint and {kill_after} steps within 300 s"
        ckpts = Path(workdir) / "checkpoints"
        saved = ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())
        if saved and len(train_records(workdir)) >= kill_after:
            break  # past a finished checkpoint (saves are asynchronous)
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def kill_at_mixed_checkpoint(proc, workdir, min_step: int, need_scored: bool = True) -> int:
    """SIGKILLs the run right after the first checkpoint at or after `min_step` that carries
    both scored-but-untrained groups and groups still in flight (only the latter without
    `need_scored`); returns its step."""
    deadline, seen = time.time() + 300, set()
    ckpts = Path(workdir) / "checkpoints"
    while True:
        assert proc.poll() is None, (
            "the run ended before a checkpoint held both kinds of "
            f"pending groups (checked {sorted(seen)})"
        )
        assert time.time() < deadline
        # A step's directory gets its final name only once every item is written.
        steps = (
            sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
            if ckpts.is_dir()
            else []
        )
        for step in (s for s in steps if s >= min_step and s not in seen):
            seen.add(step)
            pending = json.loads((ckpts / str(step) / "extra" / "metadata").read_text())["pending"]
            scored = any("samples" in g for g in pending) or not need_scored
            if scored and any("samples" not in g for g in pending):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return step
        time.sleep(0.02)


def test_pipeline_kill_9_then_resume_trains_every_prompt_once(tmp_path):
    check_kill_9_then_resume(tmp_path, PIPELINE_FLAGS, "configs/tiny.py")


def check_kill_9_then_resume(tmp_path, flags, config_file, need_scored: bool = True):
    """Kills a pipeline run of `flags` (10 steps of 4 groups) right after a checkpoint with
    both kinds of pending groups (in-flight ones only without `need_scored`), resumes it, and
    checks every prompt trained once, in order."""
    killed = tmp_path / "killed"
    # Steps train groups in start order, and groups start in stream order: step s trains the
    # stream's problems 4s .. 4s + 3, whatever the timing (an uninterrupted run does too).
    from pipelinerl_jax import config_cli
    from pipelinerl_jax.data.datasets import PromptStream
    from pipelinerl_jax.pipeline.components import build_data
    from pipelinerl_jax.pipeline.config_dict import from_config_dict

    cfg = from_config_dict(config_cli.load_file(str(ROOT / config_file)))
    stream = PromptStream(build_data(cfg)[1], seed=cfg.data.shuffle_seed + cfg.seed)
    ref_prompts = {s: [next(stream).uid for _ in range(4)] for s in range(10)}

    min_step = random.Random(KILL_SEED + 1).choice([2, 4])
    killed_at = kill_at_mixed_checkpoint(
        launch(killed, wait=False, flags=flags), killed, min_step, need_scored
    )
    context = (
        f"killed after the checkpoint at step {killed_at} (the first with both kinds of "
        f"pending groups from step {min_step}, drawn by random.Random({KILL_SEED + 1}))"
    )

    resumed = launch(killed, flags=flags)
    assert resumed.returncode == 0, (context, resumed.stderr[-3000:])
    found = re.search(
        r"resumed from step (\d+): (\d+) untrained groups carried over", resumed.stdout
    )
    assert found, (context, resumed.stdout[-2000:])
    step, carried = int(found.group(1)), int(found.group(2))

    # What the checkpoint carried over: groups already scored (with their samples) and
    # groups still being generated (prompts only, regenerated on resume).
    from pipelinerl_jax.train.checkpoint import RunCheckpointer

    extra = RunCheckpointer(killed, read_only=True).read_json(step, "extra")
    pending = extra["pending"]
    assert len(pending) == carried > 0, context
    scored = [g for g in pending if "samples" in g]
    in_flight = [g for g in pending if "samples" not in g]
    assert step == killed_at, context
    assert (scored or not need_scored) and in_flight, (context, len(scored), len(in_flight))

    by_step = {r["step"]: r["prompts"] for r in train_records(killed)}  # last record per step
    assert sorted(by_step) == list(range(10)), context
    for s in range(10):
        assert by_step[s] == ref_prompts[s], (context, s)
    trained = [uid for s in range(10) for uid in by_step[s]]
    assert len(trained) == len(set(trained)) == 10 * 4, context  # each prompt once
    assert set(trained) == {uid for s in range(10) for uid in ref_prompts[s]}
    after = [uid for s in range(step, 10) for uid in by_step[s]]
    for group in pending:  # every carried-over group was trained after the resume, once
        assert after.count(group["problem"]["uid"]) == 1, (context, group["index"])


def test_changed_model_shape_is_refused_on_resume(tmp_path, uninterrupted):
    workdir = tmp_path / "run"
    shutil.copytree(uninterrupted, workdir)  # the other test reads it: relaunch a copy
    second = launch(workdir, "--config.steps=8", "--config.model.init.hidden_size=64")
    assert second.returncode == 2
    assert "hidden_size" in second.stderr.strip().splitlines()[-1]
