"""Does the real model learn? SmolLM2-135M-Instruct on word problems (configs/smollm2_math.py).

    make real-model                                    # once
    python bench/real_learning.py                      # seeds 0-2, 48 steps each (<= 30 min each)
    python bench/real_learning.py --seeds=0 --steps=12
    python bench/real_learning.py --from_workdir=runs/learn0 --seeds=0   # summarise a run
    python bench/real_learning.py --seeds=0,1,2 --summarise   # the seeds' finished runs again
    python bench/real_learning.py --name=real_learning_lora --seeds=0 \
        --set=model.lora.rank=16 --set=trainer.learning_rate=1e-4   # LoRA (docs/lora.md)

Each seed runs `launch.py --config=configs/smollm2_math.py --config.seed=S` in its own process
(one at a time: the two cores are the whole machine), with held-out greedy evaluation of the
starting policy (step 0), halfway and at the end. Reported per seed: held-out accuracy
(math-verify on the last \\boxed{}) and boxed rate (a parsed boxed answer, right or wrong)
before and after, their gains against the goals (+0.10 accuracy, +0.30 boxed rate), the
sampled reward and answered fraction per step, wall time and steady seconds per step. The run
prompts with one worked example (configs/smollm2_math.py), under which the starting model
already boxes most answers; so the starting model and each seed's final policy are also
scored zero-shot (the paper's system prompt alone, `evaluate --nofew_shot`), where the
starting model boxes few. Each launch's RSS is sampled every 0.2 s into
<workdir>/rss_trace.csv (bench/rss_trace.py), beside its step lines in the run's log.
Writes bench/results/real_learning.json and real_learning.png.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.rss_trace import RssTrace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"accuracy": 0.10, "boxed": 0.30}


def boxed_rate(record: dict) -> float:
    """Parsed boxed answers (correct or wrong) / attempts, from an eval record's statuses."""
    status = record["status"]
    return (status["correct"] + status["wrong"]) / max(1, sum(status.values()))


def summarise(workdir: Path) -> dict:
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not evals:
        raise SystemExit(f"{workdir}: no eval records; was eval.at_start / eval_every set?")
    first, last = evals[0], evals[-1]
    out = {
        "workdir": str(workdir),
        "steps": len(train),
        "eval": [
            {"step": r["step"], "accuracy": r["avg@k"], "boxed": boxed_rate(r)} for r in evals
        ],
        "accuracy_before": first["avg@k"],
        "accuracy_after": last["avg@k"],
        "boxed_before": boxed_rate(first),
        "boxed_after": boxed_rate(last),
        "train": [
            {
                "step": r["step"],
                "time": r["time"],
                "reward": r["reward/mean"],
                "answered": r.get("status/correct", 0) + r.get("status/wrong", 0),
                "train_s": r.get("time/train_s"),
            }
            for r in train
        ],
    }
    out["accuracy_gain"] = out["accuracy_after"] - out["accuracy_before"]
    out["boxed_gain"] = out["boxed_after"] - out["boxed_before"]
    times = [r["time"] for r in train]
    out["steady_s_per_step"] = (times[-1] - times[len(times) // 2]) / max(
        1, len(times) - 1 - len(times) // 2
    )
    out["meets_goals"] = (
        out["accuracy_gain"] >= GOALS["accuracy"] and out["boxed_gain"] >= GOALS["boxed"]
    )
    # The run's peak RSS (getrusage: the whole process, evaluations included).
    peaks = [r["memory/peak_rss_gib"] for r in records if "memory/peak_rss_gib" in r]
    if peaks:
        out["peak_rss_gib"] = max(peaks)
    wall = workdir / "wall_s.json"
    if wall.exists():  # launch to exit: compilation, evaluations and every step
        launched = json.loads(wall.read_text())
        out["wall_s"] = launched["wall_s"]
        if "estimate_gib" in launched:
            out["memory_estimate_gib"] = launched["estimate_gib"]
    zero = workdir / "zero_shot.json"
    if (workdir / "checkpoints").is_dir():
        if not zero.exists():
            zero_shot([f"--workdir={workdir}", "--nofew_shot"], zero)
        r = json.loads(zero.read_text())
        out["zero_shot_after"] = {"accuracy": r["avg@k"], "boxed": boxed_rate(r)}
    return out


# Zero-shot held-out evaluation: the same 40 difficulty-1 problems as the in-run evaluation,
# greedy, the run's 144-token budget, the paper's system prompt and no worked example.
ZERO_SHOT = [
    "--task=word_problems",
    "--num_problems=40",
    "--greedy",
    "--max_new_tokens=144",
    "--noprogress",
]
START_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


def zero_shot(model_args: list[str], out: Path) -> dict:
    """Held-out greedy accuracy and boxed rate without the worked example."""
    cmd = [sys.executable, "-m", "pipelinerl_jax.evaluate", *model_args, *ZERO_SHOT, f"--out={out}"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    return {
        "accuracy": r["avg@k"],
        "boxed": boxed_rate(r),
        "command": " ".join(["python -m pipelinerl_jax.evaluate", *cmd[3:]]),
    }


def memory_estimate_gib(flags: list[str]) -> float:
    """The start-up memory estimate of a launch with these flags (its --dry_run), beside the
    run's measured peak RSS."""
    dry = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *flags, "--dry_run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(re.search(r"memory estimate: ([\d.]+) GiB", dry.stdout + dry.stderr)[1])


def re_estimate(workdir: Path) -> None:
    """Recomputes a finished run's memory estimate with this checkout's model of it (the
    launch flags recorded in wall_s.json, minus the workdir)."""
    wall = workdir / "wall_s.json"
    launched = json.loads(wall.read_text())
    # Runs before the flags were stored whole kept only the command line (no quoted flags).
    flags = launched.get("flags") or shlex.split(launched["command"])[1:]
    flags = [f for f in flags if not f.startswith("--workdir=")]
    launched["estimate_gib"] = memory_estimate_gib(flags)
    wall.write_text(json.dumps(launched))


CONFIG = "configs/smollm2_math.py"


def seed_overrides(seed: int, steps: int, overrides=()) -> list[str]:
    """A seed's config overrides (FIELD=VALUE, each passed as --config.FIELD=VALUE)."""
    return [
        f"seed={seed}",
        f"steps={steps}",
        f"eval_every={max(1, steps // 2)}",
        # one checkpoint, the final policy: `evaluate --workdir` can score it on more problems
        f"checkpoint_every={steps}",
        *overrides,
    ]


def run_seed(seed: int, steps: int, root: Path, overrides: list[str] = ()) -> Path:
    workdir = root / f"seed_{seed}"
    if (workdir / "wall_s.json").exists():
        # A launch there would resume a finished run, train nothing, and this script would
        # rewrite the result with that no-op's wall time.
        print(
            f"real_learning.py: {workdir} holds a finished run; pass --root=NEW_DIR to run "
            "again, or --summarise to re-read it",
            file=sys.stderr,
        )
        sys.exit(2)
    flags = [
        f"--config={CONFIG}",
        *(f"--config.{o}" for o in seed_overrides(seed, steps, overrides)),
    ]
    estimate = memory_estimate_gib(flags)
    cmd = [sys.executable, str(ROOT / "launch.py"), *flags, f"--workdir={workdir}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    trace = RssTrace(proc.pid, workdir / "rss_trace.csv")
    with trace:
        code = proc.wait()
    wall = time.perf_counter() - t0
    if code:  # launch.py said why (a refused config: code 2, one line)
        if code != 2:
            print(f"error: launch.py exited {code} (seed {seed}, {workdir})", file=sys.stderr)
        sys.exit(code)
    print(trace.summary())
    print(f"seed {seed}: {wall:.0f} s")
    (workdir / "wall_s.json").write_text(
        json.dumps(
            {
                "wall_s": wall,
                "command": shlex.join(cmd[1:]),
                "flags": flags,
                "estimate_gib": estimate,
            }
        )
    )
    return workdir


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in results:
        steps = [t["step"] for t in r["train"]]
        ax1.plot(steps, [t["reward"] for t in r["train"]], label=f"reward, {r['workdir']}")
        ax1.plot(steps, [t["answered"] for t in r["train"]], "--", label="answered (sampled)")
        ev = r["eval"]
        ax2.plot([e["step"] for e in ev], [e["accuracy"] for e in ev], "o-", label="accuracy")
        ax2.plot([e["step"] for e in ev], [e["boxed"] for e in ev], "s--", label="boxed rate")
    ax1.set(xlabel="optimizer step", title="sampled (the run's temperature)")
    ax2.set(xlabel="optimizer step", title="held-out, greedy", ylim=(0, 1))
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--root", default=None, help="default: runs/<name>")
    p.add_argument("--name", default="real_learning", help="the result's name (results/<name>)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        help="a config override without --config., e.g. model.lora.rank=16 (repeatable)",
    )
    p.add_argument("--from_workdir", default=None, help="summarise this finished run instead")
    p.add_argument(
        "--summarise",
        action="store_true",
        help="summarise the seeds' finished runs under --root, without running",
    )
    p.add_argument(
        "--re_estimate",
        action="store_true",
        help="with --summarise: recompute each run's memory estimate with this checkout",
    )
    args = p.parse_args()
    seeds = common.number_list(args.seeds, "--seeds", minimum=0, example="0,1,2")
    common.at_least(args.steps, "--steps")
    common.result_name(args.name)
    args.root = args.root or str(ROOT / "runs" / args.name)
    if args.from_workdir and not (Path(args.from_workdir) / "metrics.jsonl").is_file():
        common.refuse(f"--from_workdir={args.from_workdir}: no metrics.jsonl; give a run's workdir")
    if not args.from_workdir and not args.summarise:
        for s in seeds:  # each run's config as launch.py checks it, before the first run
            common.check_launch_config(CONFIG, seed_overrides(s, args.steps, args.set))
    if args.from_workdir:
        workdirs = [Path(args.from_workdir)]
    elif args.summarise:
        workdirs = [Path(args.root) / f"seed_{s}" for s in seeds]
    else:
        common.warn_if_busy()
        workdirs = [run_seed(s, args.steps, Path(args.root), args.set) for s in seeds]
    if args.re_estimate:
        for w in workdirs:
            re_estimate(w)
    results = [summarise(w) for w in workdirs]
    start = Path(args.root) / "zero_shot_start.json"
    zero_start = None
    if START_MODEL.is_dir():
        if not start.exists():
            zero_shot([f"--model_dir={START_MODEL}", "--chat"], start)
        r = json.loads(start.read_text())
        zero_start = {"accuracy": r["avg@k"], "boxed": boxed_rate(r)}
    for r in results:
        print(
            f"{r['workdir']}: accuracy {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}"
            f" ({r['accuracy_gain']:+.3f}), boxed {r['boxed_before']:.3f} -> "
            f"{r['boxed_after']:.3f} ({r['boxed_gain']:+.3f}), {r['steps']} steps, "
            f"{r['steady_s_per_step']:.0f} s/step steady"
            + (f", {r['wall_s'] / 60:.1f} min in all" if "wall_s" in r else "")
        )
        if zero_start and "zero_shot_after" in r:
            z = r["zero_shot_after"]
            print(
                f"  zero-shot: accuracy {zero_start['accuracy']:.3f} -> {z['accuracy']:.3f}, "
                f"boxed {zero_start['boxed']:.3f} -> {z['boxed']:.3f}"
            )
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot(results, common.RESULTS_DIR / f"{args.name}.png")
    steps = sorted({r["steps"] for r in results})
    named = "" if args.name == "real_learning" else f" --name={args.name}"
    sets = "".join(f" --set={o}" for o in args.set)
    common.write_result(
        args.name,
        {
            # The runs' command (a --summarise pass only re-reads them and adds zero-shot scores).
            "command": f"python bench/real_learning.py{named} --seeds={args.seeds} --steps="
            + "/".join(map(str, steps))
            + sets,
            "overrides": args.set,
            "goals": GOALS,
            "seeds": seeds,
            "runs": results,
            "zero_shot_start": zero_start,
            "zero_shot_command": " ".join(
                ["python -m pipelinerl_jax.evaluate", "--workdir=W", "--nofew_shot", *ZERO_SHOT]
            ),
        },
    )


if __name__ == "__main__":
    main()
