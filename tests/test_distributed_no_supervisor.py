"""Processes of one run launched one by one (as on separate hosts), with no supervisor to
stop them: a failing process is named in one line by every other process, which stops.
Its own file: each case is a three-process launch (about half a minute on 2 cores), and the
test runner then spreads these apart from test_distributed_launch.py's runs."""

import signal
import subprocess
import sys
import time

import pytest

from tests.launching import ROOT


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
                        "--config=configs/tiny.py",
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
