"""What deterministic pipeline mode costs: trained samples/s against the default, same config.

Runs `launch.py` on one config and seed, alternating the default pipeline mode and
`--config.deterministic=true` (and its `swap_chunks` choices), `--repeats` times each, one run
at a time, with checkpoints off and then on (a deterministic run drains before each
checkpoint). From each run's metrics.jsonl:

- steady trained samples/s: the batches trained after `--warmup` steps over their wall time
  (compilation and the first steps left out);
- the reward over the last fifth of the steps (the runs must still learn), the mean token lag
  and the share of sequences that span a swap (deterministic swaps are still in flight);
- whether two deterministic runs trained the same batches (replay/batch_crc of every step).

Usage:
  python bench/bench_deterministic.py                      # the demo, 200 steps, 3 repeats
  python bench/bench_deterministic.py --steps=100 --repeats=1 --swap_chunks=0,2,8
Writes bench/results/deterministic[_NAME].json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_flags(steps: int, extra: list[str], checkpoint_every: int) -> list[str]:
    """A run's config overrides, as launch.py flags."""
    return [
        f"--config.steps={steps}",
        "--config.eval_every=0",
        f"--config.checkpoint_every={checkpoint_every}",
        *extra,
    ]


def run(config: str, steps: int, extra: list[str], checkpoint_every: int, workdir: Path) -> dict:
    flags = [
        f"--config={config}",
        *run_flags(steps, extra, checkpoint_every),
        f"--workdir={workdir}",
    ]
    common.run_launch(
        [sys.executable, str(ROOT / "launch.py"), *flags], cwd=ROOT, stdout=subprocess.DEVNULL
    )
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    train = [json.loads(line) for line in lines if '"kind": "train"' in line]
    return {"command": " ".join(["python launch.py", *flags[:-1]]), "train": train}


def summarise(train: list[dict], batch_size: int, warmup: int) -> dict:
    start, end = train[warmup], train[-1]
    fifth = max(1, len(train) // 5)
    return {
        "steps": len(train),
        "trained_samples_per_s": batch_size
        * (end["step"] - start["step"])
        / (end["time"] - start["time"]),
        "reward_last_fifth": float(np.mean([r["reward/mean"] for r in train[-fifth:]])),
        "lag_token_mean": float(np.mean([r["lag/token_mean"] for r in train[warmup:]])),
        "mixed_version_frac": float(np.mean([r["seq/mixed_version_frac"] for r in train[warmup:]])),
        "batch_crcs": [r.get("replay/batch_crc") for r in train],
    }


def main(argv=None):
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/default.py")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--swap_chunks", default="0", help="deterministic variants, comma-separated")
    p.add_argument("--checkpoint_every", type=int, default=50, help="the runs with checkpoints")
    p.add_argument("--name", default="", help="results/deterministic_<name>.json")
    args = p.parse_args(argv)
    common.at_least(args.steps, "--steps")
    common.at_least(args.repeats, "--repeats")
    common.at_least(args.warmup, "--warmup", minimum=0)
    common.at_least(args.checkpoint_every, "--checkpoint_every")
    if args.steps < args.warmup + 2:  # a rate needs two steps after the warm-up
        common.refuse(
            f"--steps={args.steps} with --warmup={args.warmup}: give --steps of at least "
            "--warmup + 2 (samples/s is measured over the steps after the warm-up)"
        )
    swap_chunks = common.number_list(args.swap_chunks, "--swap_chunks", minimum=0, example="0,2,8")
    if args.name:
        common.result_name(args.name)
    variants = {"default": []}
    for k in swap_chunks:
        name = "deterministic" + (f"_swap{k}" if k else "")
        variants[name] = ["--config.deterministic=true"] + (
            [f"--config.swap_chunks={k}"] if k else []
        )
    # Every run's config, checked as launch.py checks it, before the first run starts.
    for extra in variants.values():
        for every in (0, args.checkpoint_every):
            cfg = common.check_launch_config(
                args.config,
                [f.removeprefix("--config.") for f in run_flags(args.steps, extra, every)],
            )
    bs = cfg.batch_size
    load = common.warn_if_busy()
    runs: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for every in (0, args.checkpoint_every):
            for rep in range(args.repeats):  # alternating: drift hits every variant alike
                for name, extra in variants.items():
                    key = f"{name}{'_ckpt' if every else ''}"
                    wd = Path(tmp) / f"{key}_{rep}"
                    out = run(args.config, args.steps, extra, every, wd)
                    runs.setdefault(key, []).append(
                        {"command": out["command"], **summarise(out["train"], bs, args.warmup)}
                    )
                    print(key, rep, f"{runs[key][-1]['trained_samples_per_s']:.0f} samples/s")
    rows, result = [], {}
    for key, reps in runs.items():
        base = runs["default_ckpt" if key.endswith("_ckpt") else "default"]
        med = float(np.median([r["trained_samples_per_s"] for r in reps]))
        base_med = float(np.median([r["trained_samples_per_s"] for r in base]))
        crcs = [r["batch_crcs"] for r in reps]
        result[key] = {
            "command": reps[0]["command"],
            "trained_samples_per_s_median": med,
            "over_default": med / base_med,
            "reward_last_fifth_median": float(np.median([r["reward_last_fifth"] for r in reps])),
            "lag_token_mean": float(np.median([r["lag_token_mean"] for r in reps])),
            "mixed_version_frac": float(np.median([r["mixed_version_frac"] for r in reps])),
            "replayed_identically": (
                all(c == crcs[0] for c in crcs) if crcs[0][0] is not None else None
            ),
            "runs": [{k: v for k, v in r.items() if k != "batch_crcs"} for r in reps],
        }
        rows.append({"variant": key, **{k: result[key][k] for k in list(result[key])[1:7]}})
    common.print_table(
        rows,
        ["variant", "trained_samples_per_s_median", "over_default", "reward_last_fifth_median"]
        + ["lag_token_mean", "mixed_version_frac", "replayed_identically"],
    )
    name = "deterministic" + (f"_{args.name}" if args.name else "")
    common.write_result(
        name,
        {
            "command": f"python bench/bench_deterministic.py --config={args.config} "
            f"--steps={args.steps} --repeats={args.repeats} --swap_chunks={args.swap_chunks} "
            f"--checkpoint_every={args.checkpoint_every}"
            + (f" --name={args.name}" if args.name else ""),
            "config": args.config,
            "load_before": load,
            "variants": result,
        },
    )


if __name__ == "__main__":
    main()
