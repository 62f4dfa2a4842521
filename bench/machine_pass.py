"""Every peer figure a machine kind still lacks, measured in one unattended pass.

    python bench/machine_pass.py --list                  # the plan: what this machine has, what not
    python bench/machine_pass.py                         # run every step this kind lacks
    python bench/machine_pass.py --since=2026-11-28      # ... or has only from before that date
    python bench/machine_pass.py --only=vs_trl_bf16_sampler,train_step_real
    python bench/machine_pass.py --all                   # re-measure everything

The peer table (bench/peer_table.py) keeps one figure per comparison and machine kind (the
2-core AMD EPYC, the 2-core Xeon with AMX). The two kinds come by chance, so the kind a session
lands on must be measured without a person remembering a dozen commands: this runs, in order of
what the open goals need most, each benchmark whose result this kind does not have (by
bench/results/by_machine/<result>.<kind>.json and its date), one at a time (they time
themselves and must not overlap), each under its own time limit, a failed step logged and
passed over. Then `bench/report.py --write` regenerates the tables.

Each step's output goes to runs/machine_pass/<stamp>/<step>.log; the pass's summary (step, exit
code, minutes, the result it wrote) to runs/machine_pass/<stamp>/summary.json. Interrupted, it
is resumed by running it again: finished steps now have this kind's result and are skipped.

What the steps need is checked before any runs (the real model, TRL and peft in .venv, Tunix's
venv): a missing piece is named with the command that installs it, the steps that need it are
passed over (the summary says why; exit 1 at the end) and the others run; when no step can
run, one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.common, when run as `python bench/machine_pass.py`

from bench import common  # noqa: E402

MODEL_DIR = "models/SmolLM2-135M-Instruct"
PYTHON = ".venv/bin/python"


@dataclasses.dataclass(frozen=True)
class Step:
    """One benchmark run: `args` after the project's python, and its limit. `name` is also the
    result it writes: bench/results/<name>.json and by_machine/<name>.<kind>.json."""

    name: str
    args: tuple[str, ...]
    minutes: float  # a generous limit: the step is killed past it and the pass goes on
    needs: tuple[str, ...] = ("model",)
    # Added to `args` when this kind's result is partial (a bench that writes row by row,
    # bench/row_results.py): the run then measures only the rows the file lacks.
    resume: tuple[str, ...] = ()
    # YYYY-MM-DD of the last change that moved this step's figure: a kind's result from before
    # it describes code that no longer runs, so the pass measures it again without --since.
    current_since: str | None = None


# In order of what the open goals need: the LoRA figures first (issue 30 waits on these four
# alone, ~2 h on a Xeon at most), then the RL step against TRL (the 3x goal) and torch (the
# train step), Tunix, what bounds the train step, then decode. `{root}` is this pass's run
# directory.
STEPS: tuple[Step, ...] = (
    Step(
        "real_learning_lora",
        (
            "bench/real_learning.py",
            "--name=real_learning_lora",
            "--root={root}/real_learning_lora",
            "--seeds=0",
            "--set=model.lora.rank=16",
            "--set=trainer.learning_rate=1e-4",
        ),
        40,
    ),
    Step(
        "vs_trl_lora",
        (
            "bench/bench_vs_trl.py",
            "--lora_rank=16",
            "--trl_steps=4",
            "--pipeline_steps=12",
            "--conventional_steps=6",
        ),
        40,
        ("model", "trl", "peft"),
    ),
    Step("weight_transfer", ("bench/bench_weight_transfer.py",), 20, ()),
    Step("lora_decode", ("bench/bench_lora_decode.py",), 20, ()),
    Step(
        "vs_trl_bf16_sampler",
        (
            "bench/bench_vs_trl.py",
            "--sampler_dtype=bfloat16",
            "--trl_steps=6",
            "--pipeline_steps=16",
            "--conventional_steps=8",
        ),
        45,
        ("model", "trl"),
    ),
    # Decode widths (the sampler decodes fewer slots as attempts finish) landed 2026-11-27.
    Step("vs_trl", ("bench/bench_vs_trl.py",), 40, ("model", "trl"), current_since="2026-11-27"),
    Step(
        "vs_trl_bf16",
        ("bench/bench_vs_trl.py", "--compute_dtype=bfloat16"),
        45,
        ("model", "trl"),
    ),
    # The bf16 weight gradients' transposed copies became uint16 moves 2026-11-28.
    Step(
        "train_step_real",
        ("bench/bench_train_step.py", f"--model_dir={MODEL_DIR}", "--head_dtype=bfloat16"),
        40,
        ("model", "torch"),
        current_since="2026-11-28",
    ),
    Step(
        "vs_tunix",
        (
            "bench/bench_vs_tunix.py",
            "--tunix_steps=4",
            "--pipeline_steps=12",
            "--conventional_steps=6",
        ),
        45,
        ("model", "tunix"),
    ),
    # What bounds the train step (no goal of their own), after the figures goals need.
    # The train step under XLA flag sets against torch, f32 and bf16 (~40 min on the EPYC):
    # whether another matmul library closes the train step's gap to torch.
    Step("train_step_xla", ("bench/train_step_xla.py",), 60, ("model", "torch")),
    # The step's matmul shapes alone against torch; since 2026-11-28 every form of each
    # weight gradient (in place, on a transposed copy, and that copy as values), so a kind
    # learns which is its faster.
    Step("gemm", ("bench/bench_gemm.py",), 20, ("torch",), current_since="2026-11-28"),
    Step("decode_widths", ("bench/bench_decode_widths.py",), 25),
    # 16 rows, each side timed 3 times: ~82 min on the EPYC. Written row by row: a pass cut
    # short leaves a partial result, and the next pass measures only the rows it lacks.
    # 16-bit pools stored as bits and the batch-1 16-bit product form landed 2026-11-28.
    Step(
        "decode_real",
        ("bench/bench_decode_real.py",),
        110,
        ("model", "torch"),
        resume=("--resume",),
        current_since="2026-11-28",
    ),
    Step(
        "real_learning_bf16",
        (
            "bench/real_learning.py",
            "--name=real_learning_bf16",
            "--root={root}/real_learning_bf16",
            "--seeds=0",
            "--set=model.compute_dtype=bfloat16",
        ),
        40,
    ),
    # The bench model's rows (no goals) and the batch-1 product forms behind the bf16 bound:
    # 2, 5, 11 and 2 min on the EPYC.
    Step("forward", ("bench/bench_forward.py",), 15, ("torch",)),
    Step("train_step", ("bench/bench_train_step.py",), 20, ("torch",)),
    Step("decode", ("bench/bench_decode.py",), 30, ("torch",), current_since="2026-11-28"),
    Step("matvec_forms", ("bench/bench_matvec_forms.py",), 15, ("torch",)),
    # The real config's peak memory (the README's row) and the accumulation forms behind it:
    # 5 and 6 min on the EPYC. The layers' gradients went into the accumulator in place
    # 2026-11-29.
    Step("real_profile", ("bench/real_profile.py", "--steps=6"), 20, current_since="2026-11-29"),
    Step("accumulation", ("bench/bench_accumulation.py",), 20),
    # What a checkpoint save adds to the peak (written in place on CPU since 2026-11-29):
    # 2 min on the EPYC.
    Step("checkpoint_memory", ("bench/bench_checkpoint_memory.py",), 10),
)

# What a need is, how to tell it is there, and the one command that provides it.
NEEDS = {
    "model": (lambda: (ROOT / MODEL_DIR / "config.json").is_file(), "make real-model"),
    "torch": (lambda: _importable(PYTHON, "torch"), "make .venv/.installed"),
    "trl": (
        lambda: _importable(PYTHON, "trl"),
        ".venv/bin/pip install -r requirements-bench.txt",
    ),
    "peft": (lambda: _importable(PYTHON, "peft"), "make .venv/.installed"),
    "tunix": (lambda: (ROOT / ".venv-tunix" / ".installed").is_file(), "make tunix-venv"),
}


def _importable(python: str, module: str) -> bool:
    exe = ROOT / python
    if not exe.exists():
        return False
    probe = [
        str(exe),
        "-c",
        f"import importlib.util, sys; sys.exit(not importlib.util.find_spec({module!r}))",
    ]
    return subprocess.run(probe, cwd=ROOT, capture_output=True).returncode == 0


def _result(results: Path, result: str, kind: str) -> dict:
    path = results / "by_machine" / f"{result}.{kind}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def result_date(results: Path, result: str, kind: str) -> str | None:
    """The date (YYYY-MM-DD) of this kind's newest `result`, or None when it has none."""
    return str(_result(results, result, kind).get("date", ""))[:10] or None


def is_partial(results: Path, result: str, kind: str) -> bool:
    """Whether this kind's `result` is a row-by-row one that stopped before its last row."""
    return _result(results, result, kind).get("complete") is False


def plan(
    steps: Sequence[Step],
    results: Path,
    kind: str,
    *,
    since: str | None = None,
    only: Sequence[str] = (),
    rerun_all: bool = False,
) -> list[tuple[Step, str | None, bool]]:
    """(step, this kind's result date or None, whether to run it) for every step, in order.

    A step runs when named in `only`; otherwise (without `only`) when `rerun_all`, when this
    kind has no result of it or only a partial one, or when that result is stale: older than
    `since` or than the step's `current_since`."""
    out = []
    for step in steps:
        date = result_date(results, step.name, kind)
        if only:
            run = step.name in only
        else:
            stale = is_stale(step, date, since)
            run = rerun_all or date is None or stale or is_partial(results, step.name, kind)
        out.append((step, date, run))
    return out


def is_stale(step: Step, date: str | None, since: str | None = None) -> bool:
    """Whether a result dated `date` is older than `since` or the step's `current_since`."""
    bounds = [d for d in (since, step.current_since) if d]
    return date is not None and any(date < d for d in bounds)


def missing_needs(steps: Sequence[Step], needs=None) -> list[str]:
    """One line per need of the steps to run that is absent: what, and the command for it."""
    needs = NEEDS if needs is None else needs
    lines = []
    for need in dict.fromkeys(n for s in steps for n in s.needs):
        present, fix = needs[need]
        if not present():
            users = ", ".join(s.name for s in steps if need in s.needs)
            lines.append(f"{need} is missing (needed by {users}): run `{fix}`")
    return lines


def probed(steps: Sequence[Step], needs) -> dict:
    """`needs` with each probe the steps use run now, once (some start a Python process)."""
    out = dict(needs)
    for need in dict.fromkeys(n for s in steps for n in s.needs):
        present, fix = needs[need]
        out[need] = (functools.partial(bool, present()), fix)
    return out


def blocked_steps(steps: Sequence[Step], needs=None) -> dict[str, str]:
    """{step name: its first absent need} for the steps that cannot run."""
    needs = NEEDS if needs is None else needs
    present = {n: needs[n][0]() for n in dict.fromkeys(n for s in steps for n in s.needs)}
    return {
        s.name: next(n for n in s.needs if not present[n])
        for s in steps
        if not all(present[n] for n in s.needs)
    }


def run_step(step: Step, root: Path, python: str, *, resume: bool = False) -> dict:
    """Runs one step to completion or its limit; its output into root/<name>.log. `resume`
    adds the step's resume flags (its result is partial)."""
    args = [a.replace("{root}", str(root)) for a in (*step.args, *(step.resume if resume else ()))]
    log = root / f"{step.name}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.monotonic()
    with log.open("w") as out:
        print(f"$ {python} {' '.join(args)}", file=out, flush=True)
        try:
            rc = subprocess.run(
                [python, *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=step.minutes * 60,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {
        "step": step.name,
        "command": f"python {' '.join(args)}",
        "rc": rc,
        "minutes": round((time.monotonic() - start) / 60, 1),
        "log": str(log.relative_to(ROOT) if log.is_relative_to(ROOT) else log),
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="print the plan and stop")
    p.add_argument("--only", default="", help="comma-separated step names (see --list)")
    p.add_argument("--since", default=None, help="YYYY-MM-DD: re-measure results older than it")
    p.add_argument("--all", action="store_true", help="re-measure every step")
    p.add_argument("--root", default=None, help="default: runs/machine_pass/<UTC stamp>")
    p.add_argument("--no_report", action="store_true", help="skip bench/report.py --write")
    p.add_argument("--python", default=PYTHON, help="the interpreter the steps run under")
    return p.parse_args(argv)


def _fail(message: str) -> int:
    print(f"machine_pass.py: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None, *, steps: Sequence[Step] = STEPS, needs=None) -> int:
    args = _parse(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - {s.name for s in steps})
    if unknown:
        return _fail(
            f"--only names no step {', '.join(unknown)}; the steps are: "
            + ", ".join(s.name for s in steps)
        )
    if args.since is not None:
        try:
            datetime.date.fromisoformat(args.since)
        except ValueError:
            return _fail(f"--since={args.since!r} is not a date; give YYYY-MM-DD")
    if only and (args.all or args.since):
        return _fail("--only picks the steps itself; drop --all / --since")
    kind = common.machine_kind(common.cpu_features())
    chosen = plan(steps, common.RESULTS_DIR, kind, since=args.since, only=only, rerun_all=args.all)
    print(f"machine kind: {kind}")
    partial = {s.name for s, _, _ in chosen if is_partial(common.RESULTS_DIR, s.name, kind)}
    for step, date, run in chosen:
        have = f"{'partial' if step.name in partial else 'has'} {date}" if date else "not measured"
        if is_stale(step, date) and not args.since:
            have += f", older than the step's last change ({step.current_since})"
        print(f"  {'run ' if run else 'skip'} {step.name:22s} {have:16s} <= {step.minutes} min")
    to_run = [step for step, _, run in chosen if run]
    # A partial result is finished, not redone: unless everything is re-measured or its rows
    # are stale (older than --since or than the step's last change).
    stale = {s.name for s, d, _ in chosen if is_stale(s, d, args.since)}
    resumed = {name for name in partial if not args.all and name not in stale}
    if args.list:
        return 0
    if not to_run:
        print("nothing to measure: every step has this kind's result (--all re-measures)")
        return 0
    # A step whose prerequisite is absent is passed over, not the whole pass: an install
    # that failed (Tunix's venv, TRL) must not cost the figures that need neither.
    needs = probed(to_run, NEEDS if needs is None else needs)  # each probe runs once
    blocked = blocked_steps(to_run, needs)
    if len(blocked) == len(to_run):
        absent = missing_needs(to_run, needs)
        return _fail(absent[0] + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""))
    for line in missing_needs(to_run, needs):
        print(f"  cannot run: {line}")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    root = Path(args.root) if args.root else ROOT / "runs" / "machine_pass" / stamp
    if root.exists() and any(root.iterdir()):
        return _fail(f"--root={root} is not empty; name a new directory")
    root.mkdir(parents=True, exist_ok=True)
    summary = {"kind": kind, "started": stamp, "steps": []}
    for step in to_run:
        if step.name in blocked:
            summary["steps"].append({"step": step.name, "rc": f"missing {blocked[step.name]}"})
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {step.name} (<= {step.minutes} min)", flush=True)
        row = run_step(step, root, args.python, resume=step.name in resumed)
        row["result_date"] = result_date(common.RESULTS_DIR, step.name, kind)
        summary["steps"].append(row)
        print(f"  rc {row['rc']}, {row['minutes']} min, log {row['log']}", flush=True)
        (root / "summary.json").write_text(json.dumps(summary, indent=2))
    if not args.no_report:
        subprocess.run([args.python, "bench/report.py", "--write"], cwd=ROOT, check=False)
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    failed = [r["step"] for r in summary["steps"] if r["rc"] != 0 and r["step"] not in blocked]
    print(
        f"done: {len(to_run) - len(failed) - len(blocked)} of {len(to_run)} steps measured"
        + (f"; failed: {', '.join(failed)} (logs in {root})" if failed else "")
        + (f"; not run, a prerequisite missing: {', '.join(blocked)}" if blocked else "")
    )
    return 1 if failed or blocked else 0


if __name__ == "__main__":
    raise SystemExit(main())
