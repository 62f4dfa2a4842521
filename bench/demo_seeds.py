"""Does the embedded default visibly learn? `launch.py` with no config flags, over 5 seeds.

    python bench/demo_seeds.py                 # seeds 0-4, one run at a time (minutes each)
    python bench/demo_seeds.py --parallel=2    # two runs at a time (each gets one core)
    python bench/demo_seeds.py --quick         # 30 steps per seed: checks the script runs
    python bench/demo_seeds.py --config=configs/guess.py --min_eval=0.9   # the multi-turn toy

Each seed runs `launch.py --config.seed=S --workdir=<root>/seed_S` in its own process, exactly
the `make run` config otherwise (override any field with --set=steps=400, repeatable). The
criterion is the one README states for the demo: the mean reward over the run's last tenth
exceeds the mean over its first 20 optimizer steps by at least --margin (0.4 on a 0-1 reward),
for every seed. Reported per seed: both means and their gain, wall time of the whole process
(compilation included) and of the run, steady steps/s, the lag histogram and the fraction of
sequences that mixed policy versions (what makes it PipelineRL), and the machine load sampled
during the run (other processes slow the run down and say nothing about the code). Results go
to bench/results/demo_seeds.json (demo_seeds_quick.json with --quick); the exit status is 1
when a seed misses the criterion (never with --quick, whose runs are too short to learn).

With --config, each seed runs that config file (results: demo_seeds_<name>.json); with
--min_eval, a seed must also end with held-out greedy success (the last evaluation's avg@k)
of at least that much. Episode runs report the last evaluation's mean turns per episode too.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    ArgumentParser,
    check_launch_config,
    load_average,
    print_table,
    refuse,
    warn_if_busy,
    write_result,
)

QUICK_STEPS = 30


class LoadSampler:
    """Samples the 1-minute load average every `period_s` seconds in a daemon thread."""

    def __init__(self, period_s: float = 5.0):
        self.period_s, self.samples = period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def stats(self) -> dict:
        s = self.samples or [os.getloadavg()[0]]
        return {"load_mean": sum(s) / len(s), "load_max": max(s)}


def run_seed(
    seed: int,
    workdir: Path,
    overrides: list[str],
    margin: float,
    config: str | None = None,
    min_eval: float | None = None,
) -> dict:
    """One run in its own process; returns its row for the table."""
    flags = [f"--config.seed={seed}", f"--workdir={workdir}", *(f"--config.{o}" for o in overrides)]
    if config:
        flags.insert(0, f"--config={config}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    log = workdir.parent / f"seed_{seed}.log"
    workdir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with LoadSampler() as load, open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), *flags],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wall = time.perf_counter() - t0
    if proc.returncode:
        tail = log.read_text()[-2000:]
        raise SystemExit(f"seed {seed}: launch.py exited {proc.returncode} (log {log}):\n{tail}")
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in reversed(records) if r["kind"] == "summary")
    first, last = summary["reward/first20"], summary["reward/last_tenth"]
    hist = {k: v for k, v in summary["lag/hist"].items() if v}
    evals = [r for r in records if r["kind"] == "eval"]
    last_eval = evals[-1] if evals else {}
    passed = last - first >= margin
    if min_eval is not None:
        passed = passed and last_eval.get("avg@k", float("-inf")) >= min_eval
    return {
        "seed": seed,
        "steps": summary["steps"],
        "first20": first,
        "last_tenth": last,
        "gain": last - first,
        "eval_first": evals[0]["avg@k"] if evals else None,
        "eval_last": last_eval.get("avg@k"),
        "eval_turns": last_eval.get("episode/turns_mean"),
        "passed": bool(passed),
        "process_wall_s": wall,
        "run_wall_s": summary["wall_s"],
        "steps_per_s": summary.get("steady_steps_per_s"),
        "mixed_seq_frac": summary["seq/mixed_version_frac"],
        "max_lag": summary["lag/token_max"],
        "lag_bound": summary["lag/bound"],
        "lag_hist": hist,
        "swaps": summary["sampler/swaps"],
        **load.stats(),
        "log": str(log),
    }


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        choices=(1, 2),
        help="runs at a time (2 on a 2-core machine: each gets a core)",
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=0.4,
        help="required gain: last-tenth reward minus first-20-steps reward",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="config override, e.g. --set=steps=400 (repeatable)",
    )
    parser.add_argument(
        "--workroot", default=None, help="keep the runs here (default: a temporary directory)"
    )
    parser.add_argument("--config", default=None, help="a config file (default: the demo)")
    parser.add_argument(
        "--min_eval",
        type=float,
        default=None,
        help="also require the last held-out evaluation's avg@k to reach this",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_STEPS} steps per seed, seeds 0-1: checks the script",
    )
    args = parser.parse_args(argv)
    overrides = list(args.set)
    if args.quick:
        overrides = [f"steps={QUICK_STEPS}", "log_every=10", *overrides]
        args.seeds = args.seeds[:2]
    if len(set(args.seeds)) < len(args.seeds):  # two runs would share one workdir
        refuse(f"--seeds {' '.join(map(str, args.seeds))}: a seed appears twice; give each once")
    if args.workroot and Path(args.workroot).exists() and not Path(args.workroot).is_dir():
        refuse(f"--workroot={args.workroot}: not a directory; give a directory to keep the runs in")
    for seed in args.seeds:  # each run's config as launch.py checks it, before the first starts
        check_launch_config(args.config, [f"seed={seed}", *overrides])
    load_before = warn_if_busy()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workroot or tmp)
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            rows = list(
                pool.map(
                    lambda s: run_seed(
                        s, root / f"seed_{s}", overrides, args.margin, args.config, args.min_eval
                    ),
                    args.seeds,
                )
            )
    total = time.perf_counter() - t0
    print_table(
        rows,
        [
            "seed",
            "steps",
            "first20",
            "last_tenth",
            "gain",
            "eval_first",
            "eval_last",
            "eval_turns",
            "passed",
            "process_wall_s",
            "steps_per_s",
            "mixed_seq_frac",
            "max_lag",
            "load_mean",
            "load_max",
        ],
    )
    passed = all(r["passed"] for r in rows)
    criterion = f"reward/last_tenth - reward/first20 >= {args.margin}"
    if args.min_eval is not None:
        criterion += f" and last held-out avg@k >= {args.min_eval}"
    print(
        f"{'PASS' if passed else 'FAIL'}: {sum(r['passed'] for r in rows)}/{len(rows)} seeds "
        f"{criterion}; slowest run {max(r['process_wall_s'] for r in rows):.0f}s "
        f"(compilation included), {total:.0f}s in all, {args.parallel} at a time"
    )
    name = "demo_seeds" + (f"_{Path(args.config).stem}" if args.config else "")
    write_result(
        name + ("_quick" if args.quick else ""),
        {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "config": args.config or "configs/default.py",
            "criterion": criterion + " for every seed",
            "overrides": overrides,
            "parallel": args.parallel,
            "quick": args.quick,
            "passed": passed,
            "total_wall_s": total,
            "load_before": load_before,
            "load_after": load_average(),
            "cpus": os.cpu_count(),
            "rows": rows,
        },
    )
    if not passed and not args.quick:
        sys.exit(1)


if __name__ == "__main__":
    main()
