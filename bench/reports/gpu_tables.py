"""The GPU tables: programs compiled for H100 topologies on CPU (bench/compile_h100.py) and
what bench/gpu_check.py measured on a lent GPU."""

from __future__ import annotations

import json

from bench.reports import results
from bench.reports.results import GiB


def _layout(r: dict) -> str:
    lay = r.get("layout") or {}
    if r["program"] == "decode_chunk":
        return f"tp {lay.get('tp', 1)}"
    if r["program"] == "train_step":
        return f"fsdp {lay.get('fsdp')} x tp {lay.get('tp')}"
    if r["program"] == "publish_prepare" or r["program"] == "publish_copy":
        return f"sampler tp {lay.get('sampler_tp')}"
    return f"fsdp {lay.get('fsdp')} x tp {lay.get('tp')}"


def _shapes(r: dict) -> str:
    s = r.get("shapes") or {}
    if r["program"] == "decode_chunk":
        return f"{s['batch']} seqs x {s['context_len']} ctx, {s['chunk_steps']} steps"
    if r["program"] == "train_step":
        return f"{s['rows']} x {s['seq_len']} tokens, {s['micro_batches']} micro"
    return "all params"


def _compile_result() -> tuple[dict | None, int]:
    d = results.load("h100_compile")
    if d is None:
        return None, 0
    from pipelinerl_jax.plan.gpu_specs import gpu_spec

    return d, gpu_spec(d["gpu"]).memory_bytes


def _compile_header(d: dict) -> str:
    return (
        f"Compiled for {d['device_kind']} on a CPU machine (jax {d['jax']}, "
        f"`{d['command']}`, {str(d['date'])[:10]}, {d['total_s']:.0f} s in all):"
    )


def _peak(r: dict | None) -> str:
    if r is None:
        return "-"
    if r.get("skipped"):
        return "heads do not divide"
    if not r.get("ok"):
        return "FAILED"
    return f"{r['memory']['peak_bytes'] / GiB:.1f}"


def _by_layout(records: list[dict]) -> dict:
    """{model: {(program, dtype, tp): record}}; skipped records have no dtype."""
    out: dict[str, dict] = {}
    for r in records:
        key = (r["program"], r.get("dtype"), (r.get("layout") or {}).get("tp"))
        out.setdefault(r["model"], {})[key] = r
    return out


def _gpu_runs() -> list[dict]:
    """Every bench/gpu_check*.json (bench/gpu_check.py on a lent GPU), oldest first."""
    runs = [json.loads(p.read_text()) for p in sorted(results.RESULTS.glob("gpu_check*.json"))]
    return sorted((r for r in runs if r.get("mode") == "gpu"), key=lambda r: r["date"])


def gpu_measured() -> str:
    """What bench/gpu_check.py measured on a GPU: the kernel test, decode against transformers,
    the train step's MFU and the pipeline run. A later run's row replaces an earlier one's."""
    runs = _gpu_runs()
    if not runs:
        return "Measured on a GPU: not yet (`bash bench/gpu_check.sh` on a lent GPU machine)."
    kernel, decode, train, pipelines, cards = None, {}, {}, [], []
    for r in runs:
        st, env = r["stages"], r["stages"].get("env", {})
        card = f"{env.get('device_kind', '?')}, {r['date'][:10]}"
        cards.append(card)
        if st.get("kernel_test", {}).get("status") in ("ok", "failed"):
            kernel = (st["kernel_test"], card)
        for row in st.get("decode", {}).get("rows", []):
            decode[(row["model"], row["batch"])] = (row, card)
        for row in st.get("train", {}).get("rows", []):
            rank = (row.get("lora") or {}).get("rank", 0)
            train[(row["model"], rank, row["rows"], row["seq_len"])] = (row, card)
        if st.get("pipeline", {}).get("status") == "ok":  # every run: they vary by machine
            pipelines.append((st["pipeline"], card))
    lines = [
        f"Measured on a GPU (`bash bench/gpu_check.sh`; {'; '.join(dict.fromkeys(cards))}):",
        "",
    ]
    if kernel:
        k, card = kernel
        errs = ", ".join(
            f"{name} {c['max_err']:.1e}{'' if c['passed'] else ' FAIL'}"
            for name, c in k["configs"].items()
        )
        lines += [
            f"- Triton paged-attention kernel against the jnp reference ({card}): "
            f"{'passed' if k['passed'] else 'FAILED'}; max error {errs}.",
        ]
    for p, card in pipelines:
        s = p["summary"]
        lines.append(
            f"- Demo pipeline run ({card}): {p['steps_done']} steps in {p['wall_s']:.0f} s, "
            f"{s['steady_samples_per_s']:.0f} samples/s after warm-up, {p['swaps']} in-flight "
            f"swaps (sampler pause {p['swap_pause_ms_mean']:.2f} ms each), max lag "
            f"{p['lag_max']} (bound {p['lag_bound']}), reward {p['reward_start']:.3f} -> "
            f"{p['reward_end']:.3f}."
        )
    if decode:
        lines += [
            "",
            "| decode (bf16, 64-token prompts, 128 new) | batch | ours tok/s | transformers "
            "tok/s | ratio | of roofline |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for (model, batch), (row, _card) in sorted(decode.items()):
            lines.append(
                f"| {model} | {batch} | {row['ours_tok_s']:.0f} | {row['hf_tok_s']:.0f} | "
                f"{row['ratio']:.1f}x | {row['ours_frac_of_predicted']:.2f} |"
            )
    if train:
        lines += [
            "",
            "| train step (bf16 compute, f32 master) | rows x seq | tok/s | MFU | of roofline |",
            "| --- | --- | --- | --- | --- |",
        ]
        for (model, rank, rows, seq), (row, _card) in sorted(train.items()):
            what = f"{model}, LoRA rank {rank} (base frozen)" if rank else model
            lines.append(
                f"| {what} | {rows} x {seq} | {row['tok_s']:.0f} | {row['mfu']:.3f} | "
                f"{row['frac_of_predicted']:.2f} |"
            )
    return "\n".join(lines)


def gpu_summary() -> str:
    """One row per model: the README's view of bench/results/h100_compile.json, then what
    bench/gpu_check.py measured on a GPU."""
    return f"{_compiled_summary()}\n\n{gpu_measured()}"


def _compiled_summary() -> str:
    d, _ = _compile_result()
    if d is None:
        return "GPU programs: not compiled yet (`make compile-h100`)."
    records = d["records"]
    decode_shapes = next(r["shapes"] for r in records if r["program"] == "decode_chunk" and r["ok"])
    train_shapes = next(r["shapes"] for r in records if r["program"] == "train_step")
    lines = [
        _compile_header(d),
        "",
        f"| model | decode chunk at tp 1 / 2 / 8, GiB per device ({decode_shapes['batch']} "
        f"seqs x {decode_shapes['context_len']}) | train step f32 / bf16, GiB per device "
        f"(FSDP 4 x TP 2, {train_shapes['rows']} x {train_shapes['seq_len']}) | publish: GiB "
        "each sampler device receives | programs compiled |",
        "| --- | --- | --- | --- | --- |",
    ]
    for model, recs in _by_layout(records).items():
        decode = [
            recs.get(("decode_chunk", "bfloat16", tp)) or recs.get(("decode_chunk", None, tp))
            for tp in (1, 2, 8)
        ]
        compiled_decode = [r for r in decode if r and r.get("ok")]
        kernel = "" if all(r["triton_kernel"] for r in compiled_decode) else " (no kernel!)"
        train = [recs.get(("train_step", dtype, 2)) for dtype in ("float32", "bfloat16")]
        copy = next((r for key, r in recs.items() if key[0] == "publish_copy"), None)
        received = f"{copy['bytes_per_device'] / GiB:.2f} ({copy['dtype']})" if copy else "-"
        # Compiled programs and failed ones; not the skips, nor the copy (no program).
        tried = [r for r in recs.values() if "memory" in r or r.get("ok") is False]
        compiled = sum(1 for r in tried if r.get("ok"))
        lines.append(
            f"| {model} | {' / '.join(_peak(r) for r in decode)}{kernel} | "
            f"{' / '.join(_peak(r) for r in train)} | {received} | {compiled} of {len(tried)} |"
        )
    failed = sum(1 for r in records if r.get("ok") is False)
    decodes = [r for r in records if r["program"] == "decode_chunk" and r.get("ok")]
    with_kernel = sum(1 for r in decodes if r.get("triton_kernel"))
    lines += [
        "",
        f"{with_kernel} of {len(decodes)} decode chunks have the Triton kernel in their program; "
        f"{failed} program(s) failed. "
        "Each program's row (collectives, roofline time, compile seconds) is in "
        "docs/gpu_compile.md.",
    ]
    return "\n".join(lines)


def gpu_table() -> str:
    """The GPU programs compiled for H100 topologies (bench/compile_h100.py), one row each."""
    d, memory = _compile_result()
    if d is None:
        return "GPU programs: not compiled yet (`make compile-h100`)."
    lines = [
        _compile_header(d),
        "",
        "| program | model | devices | shapes | dtype | compiled | peak GiB / device "
        "(args, temp) | fits 80 GB | roofline ms | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in d["records"]:
        head = f"| {r['program']} | {r['model']} | {r['devices']} ({_layout(r)}) |"
        if r.get("skipped"):
            lines.append(f"{head} - | - | skipped | - | - | - | {r['skipped']} |")
            continue
        if not r.get("ok"):
            lines.append(
                f"{head} {_shapes(r)} | {r.get('dtype')} | FAILED | - | - | - | {r.get('error')} |"
            )
            continue
        if "memory" not in r:  # the cross-mesh copy: bytes, no program
            gib = r["bytes_per_device"] / GiB
            lines.append(
                f"{head} all params | {r['dtype']} | no program | {gib:.2f} received "
                "| - | - | jax.device_put between meshes |"
            )
            continue
        m = r["memory"]
        notes = []
        if r.get("triton_kernel"):
            notes.append("Triton kernel in program")
        if r.get("collectives"):
            notes.append(", ".join(r["collectives"]))
        if r.get("involuntary_remats"):
            notes.append(f"{r['involuntary_remats']} involuntary remat")
        roof = f"{r['roofline_s'] * 1e3:.1f}" if r.get("roofline_s") else "-"
        lines.append(
            f"{head} {_shapes(r)} | {r['dtype']} | yes, {r['compile_s']:.0f} s | "
            f"{m['peak_bytes'] / GiB:.2f} ({m['argument_bytes'] / GiB:.2f}, "
            f"{m['temp_bytes'] / GiB:.2f}) | {'yes' if m['peak_bytes'] <= memory else 'NO'} | "
            f"{roof} | {'; '.join(notes)} |"
        )
    return "\n".join(lines)
