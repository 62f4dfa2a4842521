"""PipelineRL vs Conventional RL: same model, task and devices, equal maximum lag.

    python bench/bench_pipeline.py [--steps=200] [--lag=3] [--devices=8] [--quick]

Each mode runs `launch.py` in its own process on `--devices` simulated CPU devices (half
sample, half train), so both see identical settings except the mode:
  pipeline:     in-flight weight updates, max_lag = L
  conventional: rounds of L + 1 optimizer steps generated with frozen weights (lag <= L)
Reported per mode: samples/s and optimizer steps/s over the second half of the run
(compilation excluded), sampler and trainer busy fractions, the
sampler's pause per weight swap, the max observed lag, and reward against wall time. Results go
to bench/results/pipeline_vs_conventional.json.

What a 2-core CPU can and cannot show: the simulated devices share two cores, so generation
and training do not really run in parallel here; the comparison shows the scheduling (who
waits for whom, lag, swaps landing mid-sequence), not the GPU speedup of the paper.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    ArgumentParser,
    at_least,
    check_launch_config,
    print_table,
    refuse,
    warn_if_busy,
    write_result,
)

MODES = ("pipeline", "conventional")


def mode_overrides(mode: str, args) -> list[str]:
    """A mode's config overrides (FIELD=VALUE, each passed as --config.FIELD=VALUE)."""
    lag = f"max_lag={args.lag}" if mode == "pipeline" else f"conventional_steps={args.lag + 1}"
    return [
        f"mode={mode}",
        f"steps={args.steps}",
        "log_every=0",
        f"seed={args.seed}",
        "devices.sampler=0.5",
        "checkpoint_every=0",
        lag,
    ]


def run_mode(mode: str, args, workdir: Path) -> dict:
    flags = [f"--config.{o}" for o in mode_overrides(mode, args)]
    flags.insert(-1, f"--workdir={workdir}")  # the order the flags always had
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}",
    )
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    summary = next(r for r in records if r["kind"] == "summary")
    return {
        "mode": mode,
        "process_wall_s": time.perf_counter() - t0,
        "run_wall_s": summary["wall_s"],
        "samples_per_s": summary["steady_samples_per_s"],
        "steps_per_s": summary["steady_steps_per_s"],
        "samples_per_s_incl_compile": summary["samples_per_s"],
        "sampler_busy": summary["sampler/busy_frac"],
        "trainer_busy": summary["trainer/busy_frac"],
        "swap_pause_ms": summary["sampler/swap_pause_ms_mean"],
        "swaps": summary["sampler/swaps"],
        "max_lag": summary["lag/token_max"],
        "mixed_seq_frac": summary["seq/mixed_version_frac"],
        "reward_first20": summary["reward/first20"],
        "reward_last_tenth": summary["reward/last_tenth"],
        "reward_vs_time": [(round(r["time"], 2), r["reward/mean"]) for r in train],
    }


def main():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default 200 (--quick: 20)")
    parser.add_argument("--lag", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 steps, to check the script")
    args = parser.parse_args()
    if args.quick and args.steps is not None:
        refuse(f"--quick runs 20 steps: leave out --steps={args.steps}")
    args.steps = 20 if args.quick else 200 if args.steps is None else args.steps
    at_least(args.steps, "--steps")
    at_least(args.lag, "--lag", minimum=0)
    at_least(args.devices, "--devices")
    for mode in MODES:  # each run's config as launch.py checks it, before the first run
        check_launch_config(None, mode_overrides(mode, args))
    load = warn_if_busy()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            rows.append(run_mode(mode, args, Path(tmp) / mode))
    print_table(
        rows,
        [
            "mode",
            "samples_per_s",
            "steps_per_s",
            "sampler_busy",
            "trainer_busy",
            "swap_pause_ms",
            "max_lag",
            "mixed_seq_frac",
            "reward_first20",
            "reward_last_tenth",
        ],
    )
    ratio = rows[0]["samples_per_s"] / rows[1]["samples_per_s"]
    print(f"pipeline / conventional samples/s: {ratio:.2f}x at max lag {args.lag}")
    name = "pipeline_vs_conventional" + ("_quick" if args.quick else "")
    write_result(
        name,
        {"config": vars(args), "load_before": load, "rows": rows, "samples_per_s_ratio": ratio},
    )


if __name__ == "__main__":
    main()
