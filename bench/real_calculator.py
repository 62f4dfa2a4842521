"""Does the real model learn to use a calculator? SmolLM2-135M-Instruct on word problems with
the "equations" environment (configs/smollm2_calculator.py), a multi-turn run.

    make real-model                              # once
    python bench/real_calculator.py              # seed 0, the preset's 30 steps (~30-40 min)
    python bench/real_calculator.py --steps=4    # a shorter look
    python bench/real_calculator.py --from_workdir=runs/real_calculator/seed_0   # summarise
    python bench/real_calculator.py --name=real_calculator_large \
        --set='data.task_options={"difficulty": 1, "max_value": 1000}'   # numbers to 1000

The run evaluates the starting policy (step 0), halfway and at the end on 40 held-out
problems, greedy, as episodes with the calculator. Reported: held-out accuracy and tool use
(calculator calls per episode, the fraction of episodes with at least one) before and after,
turns per episode, and per training step the sampled reward, success and calls. Writes
bench/results/real_calculator.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def summarise(workdir: Path) -> dict:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    summary = next((r for r in reversed(records) if r["kind"] == "summary"), {})
    if not evals:
        raise SystemExit(f"{workdir}: no evaluation records; was eval_every set?")

    def ev(r):
        return {
            "step": r["step"],
            "accuracy": r["avg@k"],
            "calls_per_episode": r.get("episode/tool_calls_mean", 0.0),
            "turns_per_episode": r.get("episode/turns_mean"),
            "num_problems": r["num_problems"],
        }

    first, last = ev(evals[0]), ev(evals[-1])
    return {
        "workdir": str(workdir),
        "eval": [ev(r) for r in evals],
        "accuracy_before": first["accuracy"],
        "accuracy_after": last["accuracy"],
        "calls_before": first["calls_per_episode"],
        "calls_after": last["calls_per_episode"],
        "train": [
            {
                "step": r["step"],
                "reward": r["reward/mean"],
                "success": r["success"],
                "calls_per_episode": r.get("episode/tool_calls_mean", 0.0),
                "turns_per_episode": r.get("episode/turns_mean"),
                "version_span_max": r.get("episode/version_span_max"),
            }
            for r in train
        ],
        "wall_s": summary.get("wall_s"),
        "steps": summary.get("steps", len(train)),
    }


CONFIG = "configs/smollm2_calculator.py"


def run_overrides(args) -> list[str]:
    """The run's config overrides (FIELD=VALUE, each passed as --config.FIELD=VALUE)."""
    overrides = [f"seed={args.seed}", "eval.at_start=true", *args.set]
    if args.steps:
        overrides += [f"steps={args.steps}", f"eval_every={max(1, args.steps // 2)}"]
    return overrides


def main() -> None:
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="default: the preset's")
    p.add_argument("--root", default=str(ROOT / "runs" / "real_calculator"))
    p.add_argument("--from_workdir", default=None, help="summarise this finished run instead")
    p.add_argument("--name", default="real_calculator", help="the result file's name")
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="a config override"
    )
    args = p.parse_args()
    common.result_name(args.name)
    common.at_least(args.steps, "--steps")
    if args.from_workdir:
        if not (Path(args.from_workdir) / "metrics.jsonl").is_file():
            common.refuse(
                f"--from_workdir={args.from_workdir}: no metrics.jsonl; give a run's workdir"
            )
    else:
        common.check_launch_config(CONFIG, run_overrides(args))
    load_before = common.warn_if_busy()
    t0 = time.perf_counter()
    if args.from_workdir:
        workdir = Path(args.from_workdir)
    else:
        workdir = Path(args.root) / args.name / f"seed_{args.seed}"
        cmd = [sys.executable, str(ROOT / "launch.py"), f"--config={CONFIG}"]
        cmd += [f"--workdir={workdir}", *(f"--config.{o}" for o in run_overrides(args))]
        common.run_launch(cmd, cwd=ROOT)
    result = summarise(workdir)
    wall = time.perf_counter() - t0
    common.print_table(
        result["eval"], ["step", "accuracy", "calls_per_episode", "turns_per_episode"]
    )
    print(
        f"held-out accuracy {result['accuracy_before']:.3f} -> {result['accuracy_after']:.3f}, "
        f"calculator calls per episode {result['calls_before']:.2f} -> "
        f"{result['calls_after']:.2f} ({wall:.0f} s)"
    )
    common.write_result(
        args.name,
        {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "config": "configs/smollm2_calculator.py",
            "overrides": args.set,
            "seed": args.seed,
            "process_wall_s": wall,
            "load_before": load_before,
            "load_after": common.load_average(),
            **result,
        },
    )


if __name__ == "__main__":
    main()
