"""One table of every ratio against a peer (Tunix, TRL, transformers, torch), per machine kind.

Each row is one comparison; each machine kind this project runs on (the 2-core AMD EPYC, the
2-core Xeon with AMX) gets a column holding that kind's newest figure (bench/results/by_machine
keeps one per kind, bench/common.write_result). The goal column is the issue's goal for that
ratio, and "met" says whether every machine kind meets it: a goal is met only when it holds on
both kinds, so a kind that has not measured the row leaves it unmet; an unmet goal stands
beside what bounds it. `python bench/report.py
--write` puts the table in the README and in docs/benchmarks.md.

A renderer turns one result into `Row`s: goal is None for ratios with no goal, else (">=", x)
or ("<=", x): higher is better for speed, lower for memory. A row may carry its own date
(results written row by row carry one per row, bench/row_results.py; otherwise the result's
date is the row's) and what the figure's own numbers say bounds it on that machine kind (the
decode rows: how much of the machine's rate the goal would need); an unmet goal shows both
that and the source's measured bound.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

KINDS = ("epyc", "xeon")  # this project's machines, in column order
KIND_NAME = {"epyc": "AMD EPYC", "xeon": "Intel Xeon"}
KIND_LABEL = {"epyc": "AMD EPYC (AVX-512)", "xeon": "Intel Xeon (AMX)"}  # column heads
MEMORY_GOAL = ("<=", 1.0)  # "at no more than the peer's memory"
SPEED_GOAL = (">=", 3.0)  # the whole RL step, against TRL and Tunix (issue 33)
REAL = "SmolLM2-135M"


class Row(NamedTuple):
    what: str
    peer: str
    ratio: float
    goal: tuple[str, float] | None
    date: str | None = None  # the row's own date, else the result's
    bound: str | None = None  # what this figure's numbers say bounds it, on its machine kind


def _rl_step(peer: str, key: str = "") -> Callable[[dict], list[Row]]:
    """The whole RL step against a trainer library (bench_vs_trl.py, bench_vs_tunix.py)."""

    def rows(d: dict) -> list[Row]:
        what = f"{REAL} RL step" + (f", LoRA r{d['lora']['rank']}" if d.get("lora") else "")
        if d.get("sampler_dtype") == "bfloat16":
            what += ", our sampler in bf16"
        if d.get("compute_dtype") == "bfloat16":
            what += ", bf16 compute on both sides"
        goal = d.get("goal", {}).get("samples_per_s_ratio")
        out = [
            Row(
                f"{what}: samples/s, pipeline mode",
                peer,
                d["samples_per_s_ratio"],
                (">=", goal) if goal else None,
            )
        ]
        if "conventional_samples_per_s_ratio" in d:
            out.append(
                Row(
                    f"{what}: samples/s, conventional mode",
                    peer,
                    d["conventional_samples_per_s_ratio"],
                    None,
                )
            )
        out.append(Row(f"{what}: peak RSS", peer, d["peak_rss_ratio"], MEMORY_GOAL))
        return out

    return rows


def _train_step_real(d: dict) -> list[Row]:
    goals = {"float32": 1.2, "bfloat16": 1.0}  # issue 16's goals, kept by issue 33
    out = []
    for r in d["rows"]:
        if "ratio" not in r:
            continue
        what = f"{REAL} train step {r['dtype']}, {d['config']['sequences']} x "
        what += f"{d['config']['seq_len']} tokens: tokens/s"
        peer = "torch" + (" autocast" if r["dtype"] != "float32" else "")
        out.append(Row(what, peer, r["ratio"], (">=", goals[r["dtype"]])))
        if "ours_peak_gib" in r and r.get("torch_peak_gib"):
            ratio = r["ours_peak_gib"] / r["torch_peak_gib"]
            out.append(
                Row(f"{REAL} train step {r['dtype']}: peak memory", peer, ratio, MEMORY_GOAL)
            )
    return out


def _decode_rows(model: str, with_goal: bool) -> Callable[[dict], list[Row]]:
    """bench_decode_real.py's rows (SmolLM2, goals per row) or bench_decode.py's (none)."""

    def rows(d: dict) -> list[Row]:
        out = []
        for r in d["rows"]:
            sampling = "greedy" if r["temperature"] == 0 else f"temperature {r['temperature']:g}"
            if r.get("head_dtype", r["dtype"]) != r["dtype"]:
                sampling += f", {r['head_dtype']} head"
            what = f"{model} decode {r['dtype']}, batch {r['batch']}, {sampling}: tokens/s"
            goal = (">=", r["goal"]) if with_goal and r.get("goal") else None
            date = r.get("date") or d.get("date", "?")
            need = _decode_need(r, d) if goal else None
            out.append(Row(what, "transformers generate", r["ratio"], goal, date, need))
        return out

    return rows


def _decode_need(r: dict, d: dict) -> str | None:
    """What an f32 decode row's goal asks of the machine, from the row's own numbers: at batch 1
    a weight read rate (every weight is read once a token), above it a share of this machine's
    f32 matmul rate over the whole step (attention and sampling included). None for bf16 rows
    (their compute is not f32) and for results without the figures."""
    keys = ("ours_tok_s", "hf_tok_s", "goal")
    if r["dtype"] != "float32" or not all(r.get(k) for k in keys):
        return None
    need_tok_s = r["goal"] * r["hf_tok_s"]
    if r["batch"] == 1 and d.get("flop_per_token"):
        gb_per_token = d["flop_per_token"] / 2 * 4 / 1e9  # one multiply-add per f32 weight
        return (
            f"{r['goal']:g}x needs {need_tok_s * gb_per_token:.1f} GB/s of weight reads, "
            f"ours {r['ours_tok_s'] * gb_per_token:.1f}"
        )
    if r["batch"] > 1 and r.get("ours_frac_f32_matmul_peak"):
        # The share is of the rate measured in the row's own run (rows of one file may come
        # from runs on different days), so it is stated without the file's GFLOP/s.
        need = r["ours_frac_f32_matmul_peak"] * need_tok_s / r["ours_tok_s"]
        return (
            f"{r['goal']:g}x needs {need:.0%} of the machine's f32 matmul rate over the whole "
            f"step, ours {r['ours_frac_f32_matmul_peak']:.0%}"
        )
    return None


def _forward(d: dict) -> list[Row]:
    return [
        Row(
            f"bench model forward {r['dtype']}, {r['batch']} x {r['seq']} tokens: tokens/s",
            "transformers",
            r["ratio_vs_transformers"],
            None,
        )
        for r in d["rows"]
        if "ratio_vs_transformers" in r
    ]


def _train_step(d: dict) -> list[Row]:
    return [
        Row(
            f"bench model train step {r['dtype']}: tokens/s",
            "torch + transformers",
            r["ratio"],
            None,
        )
        for r in d["rows"]
        if "ratio" in r
    ]


def _decode_bound(what: str) -> str:
    """What bounds a decode row, by batch (the profiles docs/benchmarks.md details)."""
    if "batch 1," in what:
        return (
            "reading every weight each token (538 MB in f32, 269 in bf16), the bytes "
            "transformers reads too"
        )
    if "batch 64," in what:
        return (
            "attention over the staged K/V window (~0.9 GB a step in f32 at 320 positions) at "
            "~8-10 GB/s beside the matmuls, where torch runs a fused attention kernel"
        )
    if "float32" in what:
        return (
            "the projections at decode's skinny shapes: one product per core at that core's "
            "f32 rate, and products running at once share the weight read rate"
        )
    return "the matmul libraries' weight read rate at decode's skinny shapes"


# (result name, renderer, what bounds a goal the figures miss: a text, or one per row's `what`),
# in the table's order: the whole RL step first. The bounds are the measured ones
# docs/benchmarks.md details.
SOURCES: tuple[tuple[str, Callable[[dict], list[Row]], str | Callable[[str], str]], ...] = (
    ("vs_tunix", _rl_step("Tunix GRPO"), "run on the EPYC only so far"),
    (
        "vs_trl",
        _rl_step("TRL GRPOTrainer"),
        "Xeon: the sampler's f32 decode, ~70% of a step, at 1.1-1.6x transformers there",
    ),
    ("vs_trl_lora", _rl_step("TRL + peft"), "run on the EPYC only so far"),
    (
        "vs_trl_bf16_sampler",
        _rl_step("TRL GRPOTrainer"),
        "EPYC: met at 6 TRL steps (3.30x); at 4 the ratio moved 2.82-3.07x with TRL's "
        "noise alone. The Xeon figure, where bf16 decode ran 1.5-1.9x f32 (decode_real), is "
        "still to be run",
    ),
    (
        "vs_trl_bf16",
        _rl_step("TRL GRPOTrainer, bf16 autocast"),
        "run on the EPYC only so far",
    ),
    (
        "train_step_real",
        _train_step_real,
        "Xeon: XLA's GEMM rate at the step's shapes (f32 0.73-0.90x, bf16 0.36-0.83x "
        "oneDNN's); every bf16 dot runs on YNNPACK, the f32 weight gradients on XLA's own dot "
        "(the faster form on the EPYC, bench_gemm); the Xeon's flag sets and forms are still "
        "to be run (train_step_xla, gemm)",
    ),
    (
        "decode_real",
        _decode_rows(REAL, with_goal=True),
        _decode_bound,
    ),
    ("train_step", _train_step, ""),
    ("forward", _forward, ""),
    ("decode", _decode_rows("bench model", with_goal=False), ""),
)


def _kind(d: dict) -> str:
    from bench.common import machine_kind

    return machine_kind(d.get("cpu") or {})


def by_kind(results: Path, name: str) -> dict[str, dict]:
    """Each machine kind's newest `name` result: by_machine/<name>.<kind>.json, else the main
    file when that kind made it (results older than by_machine)."""
    out = {}
    for path in sorted((results / "by_machine").glob(f"{name}.*.json")):
        kind = path.name[len(name) + 1 : -len(".json")]
        if "." not in kind:
            out[kind] = json.loads(path.read_text())
    main = results / f"{name}.json"
    if main.exists():
        newest = json.loads(main.read_text())
        out.setdefault(_kind(newest), newest)
    return out


def _meets(ratio: float, goal: tuple[str, float]) -> bool:
    op, x = goal
    return ratio >= x if op == ">=" else ratio <= x


def _cell(ratio: float | None, goal, date: str) -> str:
    if ratio is None:
        return "not measured"
    mark = "" if goal is None else (" ✓" if _meets(ratio, goal) else " ✗")
    return f"{ratio:.2f}x{mark} ({date})"


def rows(results: Path) -> list[dict]:
    """Every comparison with each kind's ratio: dicts of what, peer, goal, ratios, dates, met."""
    table: dict[tuple[str, str], dict] = {}
    for name, render, bound in SOURCES:
        for kind, d in by_kind(results, name).items():
            for r in render(d):
                row = table.setdefault(
                    (r.what, r.peer),
                    {
                        "what": r.what,
                        "peer": r.peer,
                        "goal": r.goal,
                        "bound": bound(r.what) if callable(bound) else bound,
                        "ratios": {},
                        "dates": {},
                        "kind_bounds": {},
                    },
                )
                row["ratios"][kind] = r.ratio
                row["dates"][kind] = str(r.date or d.get("date", "?"))[:10]
                if r.bound:
                    row["kind_bounds"][kind] = r.bound
    kinds = list(KINDS) + sorted({k for r in table.values() for k in r["ratios"]} - set(KINDS))
    for row in table.values():
        goal = row["goal"]
        row["met"] = None
        if goal is not None:
            row["met"] = all(k in row["ratios"] and _meets(row["ratios"][k], goal) for k in KINDS)
        row["kinds"] = kinds
        row["unmet_bound"] = _unmet_bound(row) if row["met"] is False else ""
    return list(table.values())


def _unmet_bound(row: dict) -> str:
    """The source's measured bound, then each kind that misses the goal with what its own
    figure says the goal needs."""
    parts = [row["bound"]] if row["bound"] else []
    for kind in row["kinds"]:
        text = row["kind_bounds"].get(kind)
        if text and not _meets(row["ratios"][kind], row["goal"]):
            parts.append(f"{KIND_NAME.get(kind, kind)}: {text}")
    return "; ".join(parts)


def render(results: Path) -> str:
    found = rows(results)
    kinds = found[0]["kinds"] if found else list(KINDS)
    head = "| comparison | peer | goal | " + " | ".join(KIND_LABEL.get(k, k) for k in kinds)
    lines = [head + " | goal met on both | what bounds it |", "|" + " --- |" * (5 + len(kinds))]
    for r in found:
        goal = "-" if r["goal"] is None else f"{r['goal'][0]} {r['goal'][1]:g}x"
        cells = [_cell(r["ratios"].get(k), r["goal"], r["dates"].get(k, "")) for k in kinds]
        met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
        cells = " | ".join(cells)
        lines.append(
            f"| {r['what']} | {r['peer']} | {goal} | {cells} | {met} | {r['unmet_bound']} |"
        )
    if not found:
        lines.append("| no peer comparison measured yet |" + " - |" * (4 + len(kinds)))
    return "\n".join(lines)
