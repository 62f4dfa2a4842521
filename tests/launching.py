"""`python launch.py ...` from the repository root, as the multi-process tests run it, and
kill -9 of one process of a `--spawn_local` run once it has made a checkpoint."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.xla_env import child_env

ROOT = Path(__file__).resolve().parents[1]


def launch(*args, timeout: float = 300, devices: int | None = None):
    """Runs launch.py with `args` to the end; `devices`: CPU devices per process."""
    return subprocess.run(
        [sys.executable, "launch.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(devices),
    )


def _env(devices: int | None) -> dict | None:
    return None if devices is None else child_env(devices)


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


def _saved_steps(workdir: Path) -> list[int]:
    """Finished checkpoints: "<step>" (a write in progress is "<step>.orbax-checkpoint-tmp-*")."""
    return [int(d.name) for d in (workdir / "checkpoints").glob("*") if d.name.isdigit()]


def kill_9_after_a_checkpoint(
    args, workdir: Path, victim: int, name: str, devices: int | None = None
) -> str:
    """Launches `args` (a --spawn_local run), SIGKILLs process `victim` (named `name`) once
    the launch has finished a checkpoint of its own, and checks that the supervisor named it
    in one line, stopped the others within seconds and left no process behind; returns the
    output."""
    before = max(_saved_steps(workdir), default=-1)
    job = subprocess.Popen(
        [sys.executable, "launch.py", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(devices),
    )
    try:
        deadline = time.monotonic() + 180
        while max(_saved_steps(workdir), default=-1) <= before:
            assert job.poll() is None, job.stdout.read()[-3000:]
            assert time.monotonic() < deadline, f"no checkpoint after step {before} in 180 s"
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
    ), out[-3000:]
    deadline = time.monotonic() + 5  # killed processes are reaped asynchronously
    while _processes_with(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(str(workdir)) == []  # no orphans
    return out


def launches(records: list[dict]) -> list[list[dict]]:
    """metrics.jsonl's records split at each launch's "start" record."""
    starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    return [records[a:b] for a, b in zip(starts, [*starts[1:], len(records)], strict=True)]
