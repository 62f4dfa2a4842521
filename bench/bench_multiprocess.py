"""The default run as one process, 1 trainer + 1 or 2 sampler processes, and 2 trainer processes + 1 sampler (localhost).

    python bench/bench_multiprocess.py              # the default config, 400 steps per layout
    python bench/bench_multiprocess.py --steps=40   # a quick check that every layout runs

Each layout runs `launch.py` (configs/default.py, the demo) with the same seed: single process,
`--spawn_local=2` (1 trainer + 1 sampler), `--spawn_local=3` (1 trainer + 2 samplers) and
`--spawn_local=3` with `devices.trainer_processes=2` (one trainer mesh over two processes, whose
every step crosses processes through gloo), one after another. Reported per layout: steady samples/s (the run summary's, second half of the
run), wall time of the whole job, reward over the first 20 steps and the last tenth, max lag
against the bound, and the fraction of sequences that mixed policy versions.

What this shows on a 2-core machine: correctness and overheads, not speedup. Every process
shares the same two cores, so a second sampler process takes CPU from the trainer and the
first; on separate hosts (or GPUs) each process has its own. Writes
bench/results/multiprocess.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = (("1 process", []), ("1 trainer + 1 sampler", ["--spawn_local=2"]))
LAYOUTS += (("1 trainer + 2 samplers", ["--spawn_local=3"]),)
LAYOUTS += (
    ("2 trainers + 1 sampler", ["--spawn_local=3", "--config.devices.trainer_processes=2"]),
)


def run_layout(flags: list[str], steps: int, root: Path) -> dict:
    workdir = root / f"run{len(list(root.iterdir()))}"
    args = [
        sys.executable,
        "launch.py",
        f"--workdir={workdir}",
        f"--config.steps={steps}",
        "--config.checkpoint_every=0",
        "--config.eval_every=0",
        *flags,
    ]
    t0 = time.perf_counter()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(flags) or 'single process'} failed:\n{done.stdout[-3000:]}")
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in reversed(records) if r.get("kind") == "summary")
    return {
        "wall_s": wall,
        "steady_samples_per_s": summary["steady_samples_per_s"],
        "reward_first20": summary["reward/first20"],
        "reward_last_tenth": summary["reward/last_tenth"],
        "max_lag": summary["lag/token_max"],
        "lag_bound": summary["lag/bound"],
        "mixed_seq_frac": summary["seq/mixed_version_frac"],
    }


def main() -> int:
    parser = common.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    common.at_least(args.steps, "--steps")
    load = common.warn_if_busy()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in LAYOUTS:
            row = {"layout": name, **run_layout(flags, args.steps, Path(tmp))}
            rows.append(row)
            print(row, flush=True)
    base = rows[0]["steady_samples_per_s"]
    for row in rows:
        row["samples_per_s_vs_single"] = row["steady_samples_per_s"] / base
    common.print_table(
        rows,
        ["layout", "steady_samples_per_s", "samples_per_s_vs_single", "wall_s", "reward_first20"]
        + ["reward_last_tenth", "max_lag", "lag_bound", "mixed_seq_frac"],
    )
    common.write_result(
        "multiprocess" if args.steps >= 400 else "multiprocess_quick",
        {
            "config": {"config": "configs/default.py", "steps": args.steps},
            "note": "2 shared cores: correctness and overheads, not the speedup of separate hosts",
            "rows": rows,
            "load_before": load,
            "load_after": common.load_average(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
