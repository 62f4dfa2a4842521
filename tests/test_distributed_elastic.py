"""--elastic: a sampler process killed with -9 mid-run is dropped, its requests resent, and the
run finishes; the same launch command started again joins and takes work. No group is lost or
trained twice, and the lag bound holds.

One trainer and two sampler processes under the supervisor (`--spawn_local=3 --elastic`), the
toy config. Sampler 1 is killed once the trainer has logged KILL_AT steps; as soon as the
trainer says it dropped it, the killed process's own command line is run again by hand (as a
user would on its host). The run must end with exit code 0, every stream problem of its steps
trained exactly once in start order, the restarted process must have decoded attempts, and the
trainer must have attached three members (two at the start, one rejoined).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import command_of, train_records

ROOT = Path(__file__).resolve().parents[1]
STEPS, KILL_AT, MAX_LAG = 300, 30, 2
FLAGS = [
    "--config=configs/tiny.py",
    f"--config.steps={STEPS}",
    f"--config.max_lag={MAX_LAG}",
    "--config.log_every=100",
    "--config.eval_every=0",
    "--config.checkpoint_every=0",
]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _wait(predicate, what: str, proc, timeout_s: float = 240):
    deadline = time.time() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


def test_kill_9_of_a_sampler_then_a_rejoin_loses_and_repeats_nothing(tmp_path):
    workdir, log = tmp_path / "run", tmp_path / "run.log"
    # The persistent compilation cache is on (config.compile_cache "auto"): the restarted
    # process loads what the first ones compiled and joins in seconds, long before the run's
    # end, as a restart on a real host with a warm cache does.
    cmd = [sys.executable, str(ROOT / "launch.py"), *FLAGS, "--spawn_local=3", "--elastic"]
    with open(log, "w") as out:
        run = subprocess.Popen(
            [*cmd, f"--workdir={workdir}"],
            cwd=ROOT,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    rejoined = None
    try:
        _wait(lambda: len(train_records(workdir)) >= KILL_AT, f"{KILL_AT} steps", run)
        pid, argv = command_of(workdir, 2)
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: "stopped beating: dropped" in log.read_text(), "drop line", run, 60)
        killed_at = len(train_records(workdir))
        rejoined = subprocess.run(
            argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
        )
        assert run.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    text = log.read_text()
    context = f"killed after step {KILL_AT}, dropped by step {killed_at}\n{text[-3000:]}"
    assert "process 2 (sampler 1) was killed by SIGKILL; the others go on" in text, context
    assert text.count("joined;") == 3, context  # two at the start, then the restarted one
    assert rejoined.returncode == 0, rejoined.stderr[-3000:]
    served = int(rejoined.stdout.split("stopped after ")[1].split()[0])
    assert served > 0, rejoined.stdout

    records = train_records(workdir)
    assert [r["step"] for r in records] == list(range(STEPS)), context
    assert max(r["lag/token_max"] for r in records) <= MAX_LAG
    # Steps train groups in start order, and groups start in stream order: step s trains
    # the stream's problems 4s .. 4s + 3 (4 groups a step), resent ones included.
    from pipelinerl_jax import config_cli
    from pipelinerl_jax.data.datasets import PromptStream
    from pipelinerl_jax.pipeline.components import build_data
    from pipelinerl_jax.pipeline.config_dict import from_config_dict

    cfg = from_config_dict(config_cli.load_file(str(ROOT / "configs/tiny.py")))
    stream = PromptStream(build_data(cfg)[1], seed=cfg.data.shuffle_seed + cfg.seed)
    for r in records:
        assert r["prompts"] == [next(stream).uid for _ in range(4)], (r["step"], context)
