"""What the per-step heap release costs and saves: launched real-config runs, trim on and off.

    make real-model                                              # once
    python bench/bench_trim.py                                   # full fine-tune, 2 x 2 runs
    python bench/bench_trim.py --name=bench_trim_lora --set=model.lora.rank=16 \
        --set=trainer.learning_rate=1e-4                         # LoRA rank 16

`trim_host_memory` (RunConfig; pipelinerl_jax/glibc_malloc.py) calls malloc_trim(0) before each
train step so that a step starts from what is live instead of from fragmented free pages. One
run each way cannot tell its cost from the machine's drift (two single LoRA runs 45 minutes
apart differed by 0.9 s a step, 13.4 against 14.3). Here the two settings alternate (ABBA, so
neither always runs first) over `--repeats` pairs of launches of configs/smollm2_math.py with
no evaluation or checkpoint, after one untimed launch that fills the persistent compilation
cache: every timed launch then loads the same executables.

Per launch: the steady seconds per step (median of step-to-step times from step 2), the train
step's own seconds (time/train_s) and the trainer's wait for samples (time/wait_s), both
medians from step 2, and the peak RSS after the last step (the run's own
memory/peak_rss_gib). Reported: each mode's median over its launches and the trim/no-trim
ratios. Writes bench/results/<name>.json.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = common.REAL_MODEL_DIR
STEADY_FROM = 2  # steps 0-1 include compilation or cache loads and the pipeline's fill


CONFIG = "configs/smollm2_math.py"


def launch_overrides(steps: int, trim: bool, overrides: list[str]) -> list[str]:
    """A launch's config overrides (FIELD=VALUE, each passed as --config.FIELD=VALUE)."""
    return [
        f"steps={steps}",
        "eval_every=0",
        "eval.at_start=false",
        "checkpoint_every=0",
        f"trim_host_memory={'true' if trim else 'false'}",
        *overrides,
    ]


def launch(workdir: Path, steps: int, trim: bool, overrides: list[str]) -> float:
    """Runs launch.py on configs/smollm2_math.py to its end; returns its wall seconds."""
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        f"--config={CONFIG}",
        *(f"--config.{o}" for o in launch_overrides(steps, trim, overrides)),
        f"--workdir={workdir}",
    ]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"launch failed ({done.returncode}): {done.stderr[-2000:]}")
    return time.monotonic() - t0


def summarise(workdir: Path, wall_s: float) -> dict:
    """One launch's steady s/step, train and wait seconds, and peak RSS (see the docstring)."""
    train = common.train_records(workdir)
    steady = train[STEADY_FROM:]
    if len(steady) < 3:
        raise SystemExit(f"{workdir}: {len(train)} steps; use --steps >= {STEADY_FROM + 3}")
    times = [r["time"] for r in train[STEADY_FROM - 1 :]]
    return {
        "s_per_step": statistics.median(b - a for a, b in zip(times, times[1:])),
        "train_s": statistics.median(r["time/train_s"] for r in steady),
        "wait_s": statistics.median(r["time/wait_s"] for r in steady),
        "peak_rss_gib": train[-1]["memory/peak_rss_gib"],
        "peak_rss_gib_by_step": [round(r["memory/peak_rss_gib"], 3) for r in train],
        "wall_s": wall_s,
    }


def main() -> None:
    p = common.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2, help="ABBA pairs of timed launches")
    p.add_argument("--name", default="bench_trim", help="the result's name (results/<name>)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        help="a config override without --config., e.g. model.lora.rank=16 (repeatable)",
    )
    args = p.parse_args()
    if args.steps < STEADY_FROM + 3 or args.repeats < 1:
        print(f"error: use --steps >= {STEADY_FROM + 3} and --repeats >= 1", file=sys.stderr)
        sys.exit(2)
    common.result_name(args.name)
    common.require_model(MODEL_DIR)
    for trim in (True, False):  # each launch's config as launch.py checks it, before any
        common.check_launch_config(CONFIG, launch_overrides(args.steps, trim, args.overrides))
    load = common.warn_if_busy()
    root = Path(tempfile.mkdtemp(prefix="bench_trim_"))
    try:
        print("warm-up launch (fills the persistent compilation cache) ...", flush=True)
        launch(root / "warmup", STEADY_FROM + 1, True, args.overrides)
        order = []
        for r in range(args.repeats):
            order += [True, False] if r % 2 == 0 else [False, True]
        runs = []
        for i, trim in enumerate(order):
            workdir = root / f"run{i}"
            run = {
                "trim": trim,
                **summarise(workdir, launch(workdir, args.steps, trim, args.overrides)),
            }
            runs.append(run)
            print(
                f"{'trim   ' if trim else 'no trim'}  {run['s_per_step']:.2f} s/step  "
                f"train {run['train_s']:.2f} s  wait {run['wait_s']:.2f} s  "
                f"peak {run['peak_rss_gib']:.2f} GiB",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(trim: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["trim"] is trim)

    keys = ("s_per_step", "train_s", "wait_s", "peak_rss_gib")
    modes = {
        "trim": {k: med(True, k) for k in keys},
        "no_trim": {k: med(False, k) for k in keys},
    }
    ratios = {k: modes["trim"][k] / modes["no_trim"][k] for k in keys}
    common.print_table(
        [{"mode": m, **v} for m, v in modes.items()] + [{"mode": "trim / no trim", **ratios}],
        ["mode", *keys],
    )
    path = common.write_result(
        args.name,
        {
            "config": "configs/smollm2_math.py",
            "overrides": args.overrides,
            "steps": args.steps,
            "repeats": args.repeats,
            "steady_from_step": STEADY_FROM,
            "load_before": load,
            "runs": runs,
            "median": modes,
            "trim_over_no_trim": ratios,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
