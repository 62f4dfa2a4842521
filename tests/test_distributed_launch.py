"""`launch.py --spawn_local=3`: one trainer and two sampler processes under jax.distributed
run the tiny config end to end, and survive kill -9 of the trainer (the coordinator's
process) or of a sampler through a relaunch. The lag bound holds over both samplers, both decode, every
trained token's version is one the trainer published, and step 0 (all of it decoded by
version 0 in the sampler processes) trains exactly what a single-process run trains: data
order and sampling do not depend on which process decodes. Bad multi-process settings are
one line and exit code 2 before any process starts."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelinerl_jax import pipeline, presets
from tests.launching import ROOT, launch

STEPS = 6
FLAGS = ["--config=configs/tiny.py", f"--config.steps={STEPS}", "--config.checkpoint_every=0"]


def test_one_trainer_two_samplers(tmp_path):
    done = launch(*FLAGS, "--config.eval_every=0", "--spawn_local=3", f"--workdir={tmp_path}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    out = done.stdout
    served = [
        int(line.split("stopped after ")[1].split()[0])
        for line in out.splitlines()
        if "stopped after" in line
    ]
    assert len(served) == 2 and all(n > 0 for n in served), out[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == list(range(STEPS))
    bound = train[0]["lag/bound"]
    assert max(r["lag/token_max"] for r in train) <= bound
    for r in train:  # tokens trained at step s came from versions 0..s (published ones)
        assert 0 <= r["version/min"] <= r["version/max"] <= r["step"]
    single = pipeline.run(presets.tiny(steps=1, checkpoint_every=0, eval_every=0), tmp_path / "one")
    assert single["steps"] == 1
    one = [
        json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
    ]
    step0 = next(r for r in one if r.get("kind") == "train")
    assert train[0]["reward/mean"] == step0["reward/mean"]
    assert train[0]["loss"] == pytest.approx(step0["loss"], rel=1e-5)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--spawn_local=1", "--config.checkpoint_every=0"], "--spawn_local=1: use 2 or more"),
        (["--num_processes=3", "--config.checkpoint_every=0"], "needs --coordinator=host:port"),
        (
            [
                "--spawn_local=3",
                "--config.checkpoint_every=0",
                "--config.devices.trainer_processes=3",
            ],
            "trainer_processes=3: use 1..2 so that at least one of the 3 processes samples",
        ),
    ],
)
def test_bad_multi_process_settings_are_one_line(tmp_path, args, message):
    done = launch("--config=configs/tiny.py", *args, f"--workdir={tmp_path}", timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


def _processes_with(marker: str) -> list[int]:
    """Pids whose command line mentions `marker` (this test's workdir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize(
    "victim,name,trainers",
    [
        (0, "process 0 (trainer)", 1),
        (2, "process 2 (sampler 1)", 1),
        (1, "process 1 (trainer)", 2),  # a follower of a trainer spanning two processes
    ],
)
def test_kill_9_then_relaunch_resumes(tmp_path, victim, name, trainers):
    workdir = tmp_path / "run"
    args = [
        "--config=configs/tiny.py",
        f"--config.devices.trainer_processes={trainers}",
        "--config.steps=40",
        "--config.checkpoint_every=2",
        "--config.eval_every=0",
        "--spawn_local=3",
        f"--workdir={workdir}",
    ]
    job = subprocess.Popen(
        [sys.executable, "launch.py", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        # A finished checkpoint: "<step>" (a write in progress is "<step>.orbax-checkpoint-tmp-*").
        saved = lambda: [d for d in (workdir / "checkpoints").glob("*") if d.name.isdigit()]
        while not saved() and time.monotonic() < deadline:
            assert job.poll() is None, job.stdout.read()[-3000:]
            time.sleep(0.2)
        flag = f"--process_id={victim}".encode()
        target = [p for p in _processes_with(str(workdir)) if p != job.pid]
        target = [p for p in target if flag in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(target) == 1, target
        os.kill(target[0], signal.SIGKILL)
        killed_at = time.monotonic()
        out, _ = job.communicate(timeout=60)
        assert time.monotonic() - killed_at < 20
    finally:
        job.kill()
    assert job.returncode != 0
    # The supervisor stops whoever is still running; a process that saw its peer vanish may
    # have ended by itself first, so 1 or 2 are stopped. The victim is named either way.
    assert re.search(
        rf"{re.escape(name)} was killed by SIGKILL; stopped the other [12] process", out
    )
    deadline = time.monotonic() + 5  # killed processes are reaped asynchronously
    while _processes_with(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(str(workdir)) == []  # no orphans
    done = launch(*[a.replace("steps=40", "steps=12") for a in args], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "resumed from step" in done.stdout
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    last_start = max(i for i, r in enumerate(records) if r.get("kind") == "start")
    resumed_at = records[last_start]["step"]
    steps = [r["step"] for r in records[last_start:] if r.get("kind") == "train"]
    assert resumed_at >= 2 and steps == list(range(resumed_at, 12))


@pytest.mark.parametrize(
    "signum,code,line",
    [
        (signal.SIGINT, 130, "stopping: process 2 (sampler 1): KeyboardInterrupt"),
        (signal.SIGKILL, -9, "stopping: process 2 (sampler 1) stopped responding"),
    ],
)
def test_without_a_supervisor_one_process_failing_stops_the_others(tmp_path, signum, code, line):
    """Processes launched one by one (as on separate hosts): Ctrl-C of a sampler is reported
    through the key-value store, kill -9 shows as its beat stopping, and every other process
    stops, naming it in one line, before JAX's heartbeat would abort them."""
    from pipelinerl_jax.distributed import runtime

    coordinator = f"127.0.0.1:{runtime.free_port()}"
    workdir = tmp_path / "run"
    procs = []
    try:
        for i in range(3):
            log = open(tmp_path / f"p{i}.log", "w")
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "launch.py",
                        *FLAGS[:1],
                        # More steps than the run can make before the signal lands: on a fast
                        # machine 200 steps finished first and every process exited 0.
                        "--config.steps=5000",
                        "--config.checkpoint_every=0",
                        "--config.eval_every=0",
                        f"--workdir={workdir}",
                        f"--coordinator={coordinator}",
                        "--num_processes=3",
                        f"--process_id={i}",
                    ],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        metrics = workdir / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and '"train"' in metrics.read_text()):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        procs[2].send_signal(signum)
        t0 = time.monotonic()
        codes = [p.wait(timeout=60) for p in procs]
        assert time.monotonic() - t0 < 30
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"p{i}.log").read_text() for i in range(3)]
    assert codes[2] == code and codes[0] == codes[1] == 1, (codes, logs[0][-3000:])
    for i in (0, 1):
        text = (tmp_path / f"p{i}.log").read_text()
        assert line in text, text[-2000:]
