"""Elastic samplers: trained samples/s before, during and after losing a sampler process.

Runs `launch.py --spawn_local=3 --elastic` (1 trainer + 2 samplers), kills sampler 1 with -9
once `--kill_at` steps are logged, runs its own command line again as soon as the trainer has
dropped it, and reads the steps' times from metrics.jsonl:

- before: from `--warmup` to the kill;
- during: from the drop to the restarted sampler's join (one sampler left);
- after: from `--settle` steps past the join to the end;

each as trained samples/s (batches trained over wall time), with the seconds from the kill to
the drop and from the restart to the join, and whether every step trained distinct prompts.

Usage:
  python bench/bench_elastic.py                       # the demo, 800 steps
Writes bench/results/elastic.json.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def wait(predicate, timeout_s=600):
    deadline = time.time() + timeout_s
    while not predicate():
        if time.time() > deadline:
            raise TimeoutError
        time.sleep(0.05)


def rate(records, start: int, end: int, batch: int) -> float | None:
    if end - start < 2:
        return None
    return batch * (end - start) / (records[end]["time"] - records[start]["time"])


def main():
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/default.py")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--kill_at", type=int, default=150)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--settle", type=int, default=10)
    args = p.parse_args()
    common.at_least(args.steps, "--steps")
    common.at_least(args.kill_at, "--kill_at")
    common.at_least(args.warmup, "--warmup", minimum=0)
    common.at_least(args.settle, "--settle", minimum=0)
    if args.kill_at >= args.steps:
        common.refuse(
            f"--kill_at={args.kill_at} with --steps={args.steps}: the kill must come before "
            "the run ends; give --kill_at below --steps"
        )
    run_config = common.check_launch_config(
        args.config, [f"steps={args.steps}", "eval_every=0", "checkpoint_every=0"]
    )
    load = common.warn_if_busy()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    flags = [f"--config={args.config}", f"--config.steps={args.steps}", "--config.eval_every=0"]
    flags += ["--config.checkpoint_every=0", "--spawn_local=3", "--elastic"]
    with tempfile.TemporaryDirectory() as tmp:
        workdir, log = Path(tmp) / "run", Path(tmp) / "run.log"
        with open(log, "w") as out:
            run = subprocess.Popen(
                [sys.executable, str(ROOT / "launch.py"), *flags, f"--workdir={workdir}"],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        n = lambda: len(common.train_records(workdir))  # noqa: E731
        wait(lambda: n() >= args.kill_at)
        pid, argv = common.command_of(workdir, 2)
        os.kill(pid, signal.SIGKILL)
        t_kill, kill_step = time.time(), n()
        wait(lambda: "stopped beating: dropped" in log.read_text())
        t_drop, drop_step = time.time(), n()
        rejoin = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        t_restart = time.time()
        wait(lambda: log.read_text().count("joined;") >= 3)
        t_join, join_step = time.time(), n()
        code = run.wait()
        rejoin.wait()
        records = common.train_records(workdir)
        text = log.read_text()
    if code != 0:
        raise SystemExit(f"the run failed ({code}):\n{text[-3000:]}")
    batch = run_config.batch_size
    last = len(records) - 1
    phases = {
        "before": rate(records, args.warmup, kill_step - 1, batch),
        "during": rate(records, drop_step, join_step - 1, batch),
        "after": rate(records, min(join_step + args.settle, last - 2), last, batch),
    }
    prompts = [u for r in records for u in r["prompts"]]
    result = {
        "command": f"python bench/bench_elastic.py --config={args.config} --steps={args.steps} "
        f"--kill_at={args.kill_at}",
        "config": args.config,
        "load_before": load,
        "trained_samples_per_s": phases,
        "steps": {"kill": kill_step, "drop": drop_step, "join": join_step, "end": len(records)},
        "kill_to_drop_s": t_drop - t_kill,
        "restart_to_join_s": t_join - t_restart,
        "every_prompt_once": len(prompts) == len(set(prompts)),
        "max_lag": max(r["lag/token_max"] for r in records),
        "lag_bound": records[-1]["lag/bound"],
    }
    common.print_table(
        [{"phase": k, "trained_samples_per_s": v} for k, v in phases.items()],
        ["phase", "trained_samples_per_s"],
    )
    print(
        f"kill -> drop {result['kill_to_drop_s']:.1f} s, restart -> join "
        f"{result['restart_to_join_s']:.1f} s; every prompt once: {result['every_prompt_once']}"
    )
    common.write_result("elastic", result)


if __name__ == "__main__":
    main()
