"""What an in-flight weight update buys on multi-turn episodes: the guess toy
(configs/guess.py) in pipeline mode against conventional mode, same seed, same steps.

    python bench/bench_episodes.py                    # 1000 steps each (~3 min each)
    python bench/bench_episodes.py --steps=200 --latency_s=0.05   # a tool that takes time

Each mode runs `launch.py --config=configs/guess.py --config.mode=M` in its own process, one
after the other. Reported per mode: steady samples/s (episodes a second after warm-up),
reward per sample and success over the whole run and its last tenth, mean turns per episode,
the versions an episode spans, and wall time. With --latency_s, every environment turn
sleeps that long in the worker processes (env.workers=2), as a slow tool would. Writes
bench/results/bench_episodes.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from pipelinerl_jax.envs.guess import GuessNumber  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class SlowGuess(GuessNumber):
    """The guess environment with a fixed delay per turn (a tool that takes time)."""

    def __init__(self, *, latency_s: float = 0.0, **options):
        super().__init__(**options)
        self.latency_s = latency_s

    def respond(self, problem, turns):
        time.sleep(self.latency_s)
        return super().respond(problem, turns)


def run_mode(mode: str, steps: int, latency_s: float, root: Path) -> dict:
    workdir = root / mode
    flags = [
        "--config=configs/guess.py",
        f"--config.mode={mode}",
        f"--config.steps={steps}",
        "--config.eval_every=0",
        "--config.eval.at_start=false",
        "--config.checkpoint_every=0",
        f"--workdir={workdir}",
    ]
    if latency_s:
        options = {
            "higher": ">",
            "lower": "<",
            "again": "=",
            "base": 16,
            "consistency": 0.1,
            "latency_s": latency_s,
        }
        flags += [
            "--config.env.name=bench.bench_episodes:SlowGuess",
            f"--config.env.options={json.dumps(options)}",
            "--config.env.workers=2",
        ]
    t0 = time.perf_counter()
    common.run_launch(
        [sys.executable, str(ROOT / "launch.py"), *flags],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    summary = next(r for r in reversed(records) if r["kind"] == "summary")
    tenth = max(1, len(train) // 10)

    def mean(key, rows):
        return sum(r[key] for r in rows) / len(rows)

    return {
        "mode": mode,
        "steps": len(train),
        "samples_per_s": summary["steady_samples_per_s"],
        "reward_per_sample": mean("reward/mean", train),
        "reward_last_tenth": mean("reward/mean", train[-tenth:]),
        "success": mean("success", train),
        "success_last_tenth": mean("success", train[-tenth:]),
        "turns_per_episode": mean("episode/turns_mean", train),
        "version_span_max": max(r["episode/version_span_max"] for r in train),
        "max_lag": summary["lag/token_max"],
        "process_wall_s": wall,
    }


def main() -> None:
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--latency_s", type=float, default=0.0, help="seconds per environment turn")
    args = p.parse_args()
    common.at_least(args.steps, "--steps")
    common.at_least(args.latency_s, "--latency_s", minimum=0)
    load_before = common.warn_if_busy()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            run_mode(m, args.steps, args.latency_s, Path(tmp)) for m in ("pipeline", "conventional")
        ]
    common.print_table(
        rows,
        [
            "mode",
            "samples_per_s",
            "reward_per_sample",
            "reward_last_tenth",
            "success_last_tenth",
            "turns_per_episode",
            "version_span_max",
            "max_lag",
            "process_wall_s",
        ],
    )
    pipe, conv = rows
    ratio = pipe["samples_per_s"] / conv["samples_per_s"]
    print(f"pipeline / conventional samples/s: {ratio:.2f}x")
    common.write_result(
        "bench_episodes",
        {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "config": "configs/guess.py",
            "latency_s": args.latency_s,
            "ratio_samples_per_s": ratio,
            "load_before": load_before,
            "load_after": common.load_average(),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
