"""Rows of the single-program benchmarks against torch and transformers: forward, decode, the
real model's decode, projections, matvec forms, GEMMs and train steps."""

from __future__ import annotations

from bench.reports.results import REAL


def forward_rows(d):
    rows = {(r["impl"], r["dtype"]): r for r in d["rows"]}
    out = []
    for dtype in ("float32", "bfloat16"):
        ours, theirs = rows.get(("pipelinerl_jax", dtype)), rows.get(("transformers", dtype))
        if ours and theirs:
            out.append(
                (
                    f"forward {dtype}, 8 x 512 tokens: tokens/s",
                    f"{ours['tokens_per_s']:.0f} ({ours['frac_f32_peak']:.0%} of f32 matmul peak)",
                    f"{theirs['tokens_per_s']:.0f}",
                    f"{theirs['median_s'] / ours['median_s']:.2f}x",
                )
            )
    return out


def decode_rows(d):
    out = []
    for r in d["rows"]:
        peak = r.get("frac_f32_matmul_peak")
        extra = f" ({peak:.0%} of f32 peak)" if peak is not None else ""
        how = f", temperature {r['temperature']:g}" if r.get("temperature") else ""
        out.append(
            (
                f"decode {r['dtype']}, batch {r['batch']}{how}: tokens/s",
                f"{r['ours_tok_s']:.0f}{extra}",
                f"{r['hf_tok_s']:.0f}",
                f"{r['ratio']:.2f}x",
            )
        )
    swap = d.get("param_swap")
    if swap:
        out.append(
            (
                f"param swap at a chunk boundary, batch {swap['batch']}: extra cost",
                f"{swap['extra_cost_in_decode_steps']:.2f} decode steps "
                f"(recompiled: {swap['recompiled']})",
                "-",
                "-",
            )
        )
    return out


def decode_real_rows(d):
    """SmolLM2 decode rows, each against its goal (>= 2.5x f32, >= 1.5x bf16)."""
    c = d["config"]
    out = []
    for r in d["rows"]:
        how = "greedy" if not r.get("temperature") else f"temperature {r['temperature']:g}"
        if r.get("head_dtype", "float32") != r["dtype"]:
            how += f", {r.get('head_dtype', 'float32')} head"
        notes = []
        if r.get("ours_frac_f32_matmul_peak") is not None:
            notes.append(f"{r['ours_frac_f32_matmul_peak']:.0%} of f32 peak")
        if r.get("same_tokens_frac") is not None:
            notes.append(f"{r['same_tokens_frac']:.0%} same tokens")
        ours = f"{r['ours_tok_s']:.0f}" + (f" ({'; '.join(notes)})" if notes else "")
        goal = r.get("goal")
        met = "" if goal is None else (" (goal met)" if r["ratio"] >= goal else f" (goal {goal}x)")
        out.append(
            (
                f"SmolLM2-135M decode {r['dtype']}, batch {r['batch']}, {how}, {c['prompt_len']} + "
                f"{c['new_tokens']} tokens: tokens/s",
                ours,
                f"{r['hf_tok_s']:.0f}",
                f"{r['ratio']:.2f}x{met}",
            )
        )
    return out


def decode_real_range_rows(d):
    """The headline view of decode_real: one row per dtype, the range over every batch size
    and both greedy and temperature-1 sampling (each row of the full table lies inside)."""
    c = d["config"]
    out = []
    for dtype in ("float32", "bfloat16"):
        rows = [r for r in d["rows"] if r["dtype"] == dtype]
        if not rows:
            continue
        span = lambda key, fmt: (
            f"{min(r[key] for r in rows):{fmt}}-{max(r[key] for r in rows):{fmt}}"
        )
        batches = sorted({r["batch"] for r in rows})
        goals = {r["goal"] for r in rows if r.get("goal") is not None}
        met = sum(1 for r in rows if r.get("goal") is not None and r["ratio"] >= r["goal"])
        goal = f" (goal {max(goals):g}x: met in {met} of {len(rows)})" if goals else ""
        out.append(
            (
                f"SmolLM2-135M decode {dtype}, batch {'/'.join(map(str, batches))}, greedy "
                f"and temperature 1, {c['prompt_len']} + {c['new_tokens']} tokens: tokens/s",
                span("ours_tok_s", ".0f"),
                span("hf_tok_s", ".0f"),
                f"{span('ratio', '.2f')}x{goal}",
            )
        )
    return out


def projections_rows(d):
    out = []
    for r in d["rows"]:
        out.append(
            (
                f"decode layer stack without attention, f32, N = {r['tokens']}: us per layer",
                f"{r['ours_us_per_layer']:.0f} ({r['ours_weight_gb_s']:.1f} GB/s of weights)",
                f"{r['torch_us_per_layer']:.0f}",
                f"{r['ratio']:.2f}x",
            )
        )
    ceiling = d.get("gemv_ceiling_gb_s")
    if ceiling:
        out.append(
            (
                "one 166 MB f32 matrix-vector product: GB/s (the read-rate ceiling)",
                f"{ceiling['xla']:.1f}",
                f"{ceiling['torch']:.1f}",
                f"{ceiling['xla'] / ceiling['torch']:.2f}x",
            )
        )
    return out


def matvec_forms_rows(d):
    """Each way of writing batch 1's products, against torch's F.linear in the same dtype."""
    torch = {r["dtype"]: r for r in d["rows"] if r["form"].startswith("torch_")}
    out = []
    for r in d["rows"]:
        if r["form"].startswith("torch_"):
            continue
        peer = torch[r["dtype"]]
        weights = "f32 weights" if r["dtype"] == "float32" else "bf16 weights"
        out.append(
            (
                f"one decode token's matmuls, SmolLM2-135M shapes, batch 1, {weights}, form "
                f"`{r['form']}`: ms (weight read rate)",
                f"{r['ms_per_token']:.1f} ({r['weight_gb_s']:.1f} GB/s)",
                f"{peer['ms_per_token']:.1f} ({peer['weight_gb_s']:.1f} GB/s)",
                f"{peer['ms_per_token'] / r['ms_per_token']:.2f}x",
            )
        )
    return out


_GEMM_FORMS = {
    "contract": "token axis contracted in place",
    "copy": "activations copied transposed, copy timed",
    "copy_values": "activations copied transposed as values, not bits, copy timed",
}


def gemm_rows(d):
    def form(r):
        if "form" not in r:
            return ""
        step = ", the step's form" if r["step_form"] else ""
        return f" ({_GEMM_FORMS[r['form']]}{step})"

    return [
        (
            f"train-step matmul alone, {r['dtype']}, {r['shape']}{form(r)}, M x K x N = "
            f"{r['m']} x {r['k']} x {r['n']}: GFLOP/s",
            f"{r['ours_gflops']:.0f}",
            f"{r['torch_gflops']:.0f}",
            f"{r['ratio']:.2f}x",
        )
        for r in d["rows"]
    ]


def train_rows(d):
    out = []
    for r in d["rows"]:
        timed = "torch_tok_s" in r
        out.append(
            (
                f"train step {r['dtype']}, {d['config']['sequences']} x "
                f"{d['config']['seq_len']}: tokens/s",
                f"{r['ours_tok_s']:.0f}",
                f"{r['torch_tok_s']:.0f}" if timed else "not timed (too slow here)",
                f"{r['ratio']:.2f}x" if timed else "-",
            )
        )
    return out


def train_real_rows(d):
    goals = {"float32": 1.2, "bfloat16": 1.0}
    out = []
    for r in d["rows"]:
        how = ""
        if r["dtype"] != "float32":
            head = r.get("head_dtype", "float32").replace("float32", "f32").replace("bfloat", "bf")
            how = f" (f32 params, bf16 compute, {head} LM head; torch autocast)"
        theirs = "-" if "torch_s" not in r else f"{r['torch_tok_s']:.0f} ({r['torch_s']:.0f} s)"
        ratio = "-" if "ratio" not in r else f"{r['ratio']:.2f}x (goal >= {goals[r['dtype']]})"
        ours = f"{r['ours_tok_s']:.0f} ({r['ours_s']:.0f} s)"
        if "ours_peak_gib" in r:
            ours += f", peak {r['ours_peak_gib']:.2f} GiB"
            theirs += f", peak {r['torch_peak_gib']:.2f} GiB"
            ratio += f"; memory {r['ours_peak_gib'] / r['torch_peak_gib']:.2f}x"
        # Older files predate remat_policy: their remat kept the attention only.
        policy = d["config"].get("remat_policy", "attention")
        out.append(
            (
                f"{REAL}: train step {r['dtype']}{how}, {d['config']['sequences']} x "
                f"{d['config']['seq_len']} tokens (ours remat keeping {policy}, torch gradient "
                "checkpointing): "
                "tokens/s",
                ours,
                theirs,
                ratio,
            )
        )
    return out


_DT = {"float32": "f32", "bfloat16": "bf16"}


def train_xla_rows(d):
    if "timings" in d:  # before 2026-11-28: the bf16 step only, XLA flag sets only
        rows = [dict(r, dtype="bfloat16", side=k) for k, r in d["timings"].items()]
        d = dict(d, rows=[dict(rows[0], dots_ynn=d["dots_ynn"], dots_total=d["dots_total"])])
        d["rows"] += rows[1:]
    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in d["rows"]):
        by_side = {r["side"]: r for r in d["rows"] if r["dtype"] == dtype}
        dt, base, torch = _DT.get(dtype, dtype), by_side.get("default"), by_side.get("torch")
        if base and "dots_ynn" in base:
            out.append(
                (
                    f"{REAL}: {dt} train step's matmuls on XLA:CPU's YNNPACK path",
                    f"{base['dots_ynn']} of {base['dots_total']} dots",
                    "-",
                    "-",
                )
            )
        for side, r in by_side.items():
            if side == "torch" or (side == "default" and not torch):
                continue
            flags = f"`{r['xla_flags']}`" if r.get("xla_flags") else "XLA's default flags"
            vs_default = ""
            if base and side != "default":
                vs_default = f"; {base['median_s'] / r['median_s']:.2f}x XLA's default"
            out.append(
                (
                    f"{REAL}: {dt} train step with {flags}"
                    + (" vs torch" if torch else " vs XLA's default")
                    + ": seconds",
                    f"{r['median_s']:.1f} s",
                    f"{torch['median_s']:.1f} s" if torch else f"{base['median_s']:.1f} s",
                    (
                        f"{torch['median_s'] / r['median_s']:.2f}x{vs_default}"
                        if torch
                        else f"{base['median_s'] / r['median_s']:.2f}x"
                    ),
                )
            )
    return out
