"""Kill -9 a run at a random point, resume it from its workdir: nothing lost, nothing twice.

Conventional mode with a fixed seed is deterministic, so the resumed run's per-step losses
must equal an uninterrupted run's, and the prompts trained at each step must be the same.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--config=configs/tiny.py", "--config.mode=conventional",
         "--config.conventional_steps=2", "--config.steps=6", "--config.checkpoint_every=2"]


def launch(workdir, *extra, wait=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(ROOT / "launch.py"), *FLAGS, f"--workdir={workdir}", *extra]
    if wait:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def train_records(workdir):
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(l) for l in lines if '"kind": "train"' in l]


def test_kill_9_then_resume_continues_exactly(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    ref = launch(full)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_records = {r["step"]: r for r in train_records(full)}
    assert sorted(ref_records) == list(range(6))

    kill_after = random.Random().choice([3, 4, 5])  # a random point past a checkpoint
    proc = launch(killed, wait=False)
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline
        ckpts = killed / "checkpoints"
        saved = ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())
        if saved and len(train_records(killed)) >= kill_after:
            break  # past a finished checkpoint (saves are asynchronous)
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

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
        np.testing.assert_allclose(by_step[step]["loss"], ref_records[step]["loss"],
                                   rtol=1e-5, atol=1e-7)
    trained = [uid for s in range(6) for uid in by_step[s]["prompts"]]
    assert len(trained) == len(set(trained))  # no prompt trained twice


def test_changed_model_shape_is_refused_on_resume(tmp_path):
    first = launch(tmp_path, "--config.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = launch(tmp_path, "--config.steps=4", "--config.model.init.hidden_size=64")
    assert second.returncode == 2
    assert "hidden_size" in second.stderr.strip().splitlines()[-1]
