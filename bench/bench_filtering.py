"""Dynamic sampling against none: reward per sample and per second, same seed and config.

Runs `launch.py` twice on one config and seed, with `batch.filter_groups` off and on, one run
after the other, and compares from each run's metrics.jsonl:

- samples generated: every attempt trained, plus the attempts of dropped groups;
- the reward (shaped) of every group generated, dropped ones included, over the first and the
  last third of the steps, and the gain between them (the trained groups' reward alone is
  biased by the filter, which removes the all-right and all-wrong groups);
- that gain per thousand samples generated and per minute of wall time (launch to exit);
- how many groups were dropped and how many were trained only because of the refill cap.

Usage:
  python bench/bench_filtering.py                                    # the demo, 200 steps
  python bench/bench_filtering.py --config=configs/smollm2_math.py --steps=24 \
      --set=model.lora.rank=16 --set=trainer.learning_rate=1e-4        # the real model
Writes bench/results/filtering[_NAME].json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def overrides(steps: int, seed: int, filtering: bool, sets: list[str]) -> list[str]:
    """A run's config overrides (FIELD=VALUE, each passed as --config.FIELD=VALUE)."""
    return [
        f"steps={steps}",
        f"seed={seed}",
        "eval_every=0",
        "checkpoint_every=0",
        f"batch.filter_groups={filtering}",
        *sets,
    ]


def run(
    config: str,
    steps: int,
    seed: int,
    filtering: bool,
    sets: list[str],
    workdir: Path,
    group_size: int,
):
    flags = [
        f"--config={config}",
        *(f"--config.{o}" for o in overrides(steps, seed, filtering, sets)),
        f"--workdir={workdir}",
    ]
    t0 = time.perf_counter()
    common.run_launch([sys.executable, str(ROOT / "launch.py"), *flags], cwd=ROOT)
    wall = time.perf_counter() - t0
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    train = [json.loads(line) for line in lines if '"kind": "train"' in line]
    return summarise(train, group_size, wall, " ".join(["python launch.py", *flags[:-1]]))


def generated_reward(r: dict) -> float:
    """A step's mean reward over every group it walked past, dropped ones included: the
    policy's reward on what it generated (the trained groups alone are biased by the filter,
    which removes the all-right and the all-wrong ones)."""
    kept, dropped = len(r["prompts"]), r.get("filter/dropped", 0)
    total = r["reward/mean"] * kept + r.get("filter/dropped_shaped_mean", 0.0) * dropped
    return total / (kept + dropped)


def summarise(train: list[dict], group_size: int, wall: float, command: str) -> dict:
    third = max(1, len(train) // 3)
    for r in train:
        r["generated_reward"] = generated_reward(r)
    first, last = train[:third], train[-third:]
    mean = lambda rs, k: float(np.mean([r[k] for r in rs]))  # noqa: E731
    trained = sum(len(r["prompts"]) for r in train) * group_size
    dropped = train[-1].get("filter/dropped_total", 0)
    samples = trained + dropped * group_size
    gain = mean(last, "generated_reward") - mean(first, "generated_reward")
    return {
        "command": command,
        "steps": len(train),
        "wall_s": wall,
        "samples_generated": samples,
        "groups_dropped": dropped,
        "groups_forced": train[-1].get("filter/forced_total", 0),
        "reward_first_third": mean(first, "generated_reward"),
        "reward_last_third": mean(last, "generated_reward"),
        "trained_reward_last_third": mean(last, "reward/mean"),
        "success_first_third": mean(first, "success"),
        "success_last_third": mean(last, "success"),
        "reward_gain": gain,
        "gain_per_1k_samples": 1e3 * gain / samples,
        "gain_per_min": 60 * gain / wall,
        "samples_per_s": samples / wall,
    }


def main(argv=None):
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/default.py")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="a config override, a.b=v")
    p.add_argument("--name", default="", help="results/filtering_<name>.json")
    args = p.parse_args(argv)
    common.at_least(args.steps, "--steps")
    if args.name:
        common.result_name(args.name)
    # Each run's config, checked as launch.py checks it, before either run starts.
    group_size = {
        f: common.check_launch_config(
            args.config, overrides(args.steps, args.seed, f, args.set)
        ).group_size
        for f in (False, True)
    }
    load = common.warn_if_busy()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for filtering in (False, True):  # one after the other: never two timed runs at once
            key = "filtered" if filtering else "unfiltered"
            out[key] = run(
                args.config,
                args.steps,
                args.seed,
                filtering,
                args.set,
                Path(tmp) / key,
                group_size[filtering],
            )
    f, u = out["filtered"], out["unfiltered"]
    ratios = {
        k: (f[k] / u[k] if u[k] else None)
        for k in ("gain_per_1k_samples", "gain_per_min", "samples_per_s", "wall_s")
    }
    columns = ["wall_s", "samples_generated", "groups_dropped", "reward_first_third"]
    columns += ["reward_last_third", "gain_per_1k_samples", "gain_per_min"]
    rows = [{"run": k, **{c: v[c] for c in columns}} for k, v in out.items()]
    common.print_table(rows, ["run", *columns])
    name = "filtering" + (f"_{args.name}" if args.name else "")
    sets = "".join(f" --set={s}" for s in args.set)
    common.write_result(
        name,
        {
            "command": f"python bench/bench_filtering.py --config={args.config} "
            f"--steps={args.steps} --seed={args.seed}{sets}"
            + (f" --name={args.name}" if args.name else ""),
            "config": args.config,
            "load_before": load,
            **out,
            "filtered_over_unfiltered": ratios,
        },
    )


if __name__ == "__main__":
    main()
