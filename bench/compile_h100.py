"""Compile the whole GPU program for H100 topologies on this CPU machine; write what it costs.

  make compile-h100                      # every model below -> bench/results/h100_compile.json
  make compile-h100 ARGS=--quick         # the bench model only -> h100_compile_quick.json
  .venv-gpu/bin/python bench/compile_h100.py --models=qwen2.5-7b --programs=train_step

For each model (the bench model, SmolLM2-135M, Qwen2.5-1.5B, Qwen2.5-7B, and Llama-3.1-8B, whose
32 query / 8 kv heads split over 8 devices where Qwen2.5-7B's 28 do not), with random
parameters from the shapes alone (models/known_shapes.py; nothing is downloaded):
  - decode_chunk: bf16 params and cache, `paged` attention with the Triton kernel, sampler
    tensor-parallel over 1, 2 and 8 devices (where the heads divide; else a recorded skip);
  - train_step: FSDP 4 x TP 2 over 8 devices, f32 params, f32 and bf16 compute, remat
    (policy "matmuls"), 4 micro-batches;
  - publish: the trainer-side gather, the cross-mesh copy's bytes, the sampler-side prepare.
Per program: compile success (or the error's first line), per-device memory from XLA's
`memory_analysis()`, whether the Triton kernel's custom call is in the optimised HLO, the
collectives, and the roofline FLOPs and bytes (plan/roofline.py: a deviceless compile has no
cost analysis). Needs the `.venv-gpu` that `make compile-h100` builds (jax 0.11.2, its CUDA
plugin, jax-triton 0.3.1); elsewhere it exits 2 naming what is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

# Deviceless compiles: the plugin's CUDA-library check would refuse to load without them.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from bench.common import RESULTS_DIR, at_least, bench_model_config, number_list  # noqa: E402
from pipelinerl_jax.models.known_shapes import KNOWN_HF_CONFIGS, known_config  # noqa: E402
from pipelinerl_jax.plan import gpu_compile  # noqa: E402
from pipelinerl_jax.plan.gpu_specs import GPUS, gpu_spec  # noqa: E402
from pipelinerl_jax.sampler import forward as fwd  # noqa: E402

MODELS = ("bench", "smollm2-135m", "qwen2.5-1.5b", "qwen2.5-7b", "llama3.1-8b")
PROGRAMS = ("decode_chunk", "train_step", "publish")
SAMPLER_TPS = (1, 2, 8)


def model_config(name: str, **overrides):
    if name == "bench":
        return dataclasses.replace(bench_model_config(), **overrides)
    return known_config(name, **overrides)


def _roofline(record: dict, cfg) -> None:
    """FLOPs and bytes per device from the shapes (plan/roofline.py), where it applies."""
    try:
        from pipelinerl_jax.plan import roofline
    except ImportError as err:
        record["roofline"] = f"unavailable: {err}"
        return
    shapes, layout = record["shapes"], record["layout"]
    try:
        if record["program"] == "decode_chunk":
            cost = roofline.decode_step_cost(
                cfg,
                batch=shapes["batch"],
                context_len=shapes["context_len"],
                cache_dtype=record["dtype"],
                weight_dtype=record["dtype"],
                tp=layout["tp"],
            )
            steps = shapes["chunk_steps"]
        elif record["program"] == "train_step":
            cost = roofline.train_step_cost(
                cfg,
                tokens=shapes["rows"] * shapes["seq_len"],
                seq_len=shapes["seq_len"],
                remat=layout["remat"],
                devices=record["devices"],
            )
            steps = 1
        else:
            return
    except Exception as err:  # noqa: BLE001  (recorded: the compile figures stand without it)
        record["roofline"] = f"unavailable: {type(err).__name__}: {err}"
        return
    gpu = gpu_spec(record["gpu"])
    record["flops"] = cost.flops * steps
    record["bytes_accessed"] = cost.bytes * steps
    record["roofline_s"] = roofline.seconds(cost, gpu, record["dtype"]) * steps


def skip(program, model, gpu, devices, layout, reason) -> dict:
    return gpu_compile.new_record(program, model, gpu, devices, layout) | dict(
        ok=None, skipped=reason
    )


def run_model(name: str, gpu, programs, args) -> list[dict]:
    records = []
    bf16 = dict(param_dtype="bfloat16", compute_dtype="bfloat16")
    if "decode_chunk" in programs:
        cfg = model_config(name, **bf16)
        for tp in args.sampler_tps:
            try:
                fwd.check_tp(cfg, tp)
            except ValueError as err:  # ConfigError: the heads do not split over tp
                records.append(skip("decode_chunk", name, gpu, tp, {"tp": tp}, str(err)))
                continue
            rec = gpu_compile.compile_decode_chunk(
                cfg,
                gpu,
                model=name,
                tp=tp,
                batch=args.batch,
                context_len=args.context_len,
                chunk_steps=args.chunk_steps,
            )
            _roofline(rec, cfg)
            records.append(rec)
    for compute in ("float32", "bfloat16") if "train_step" in programs else ():
        cfg = model_config(
            name, param_dtype="float32", compute_dtype=compute, remat=True, remat_policy="matmuls"
        )
        rec = gpu_compile.compile_train_step(
            cfg,
            gpu,
            model=name,
            fsdp=args.fsdp,
            tp=args.tp,
            rows=args.rows,
            seq_len=args.seq_len,
            micro_batches=args.micro_batches,
        )
        _roofline(rec, cfg)
        records.append(rec)
    if "publish" in programs:
        cfg = model_config(name, param_dtype="float32", compute_dtype="bfloat16")
        sampler_tp = max(tp for tp in (1, 2) if cfg.num_kv_heads % tp == 0)
        records += gpu_compile.compile_publish(
            cfg, gpu, model=name, fsdp=args.fsdp, tp=args.tp, sampler_tp=sampler_tp
        )
    return records


def summary_line(r: dict) -> str:
    what = f"{r['program']:<16} {r['model']:<13} {r['devices']:>2} dev {r.get('dtype') or '':<9}"
    if r.get("skipped"):
        return f"{what} skipped: {r['skipped']}"
    if not r["ok"]:
        return f"{what} FAILED: {r['error']}"
    if "memory" not in r:
        return f"{what} copy {r['bytes_per_device'] / 2**30:.2f} GiB per sampler device"
    mem = r["memory"]
    extra = " triton-kernel" if r.get("triton_kernel") else ""
    if r.get("involuntary_remats"):
        extra += f" {r['involuntary_remats']} involuntary remat(s)"
    return (
        f"{what} ok {r['compile_s']:>5.1f} s  peak {mem['peak_bytes'] / 2**30:6.2f} GiB "
        f"(args {mem['argument_bytes'] / 2**30:.2f}, temp {mem['temp_bytes'] / 2**30:.2f}){extra}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--programs", default=",".join(PROGRAMS))
    p.add_argument("--quick", action="store_true", help="the bench model only, smaller shapes")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<gpu>_compile)")
    p.add_argument("--sampler_tps", default=",".join(map(str, SAMPLER_TPS)))
    p.add_argument("--batch", type=int, default=128, help="decode slots")
    p.add_argument("--context_len", type=int, default=2048, help="tokens every slot may hold")
    p.add_argument("--chunk_steps", type=int, default=16)
    p.add_argument("--fsdp", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rows", type=int, default=32, help="train rows per optimizer step")
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--micro_batches", type=int, default=4)
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    programs = [m.strip() for m in args.programs.split(",") if m.strip()]
    for m in models:
        if m != "bench" and m not in KNOWN_HF_CONFIGS:
            p.exit(
                2, f"compile_h100: unknown model {m!r}; use bench or {sorted(KNOWN_HF_CONFIGS)}\n"
            )
    for prog in programs:
        if prog not in PROGRAMS:
            p.exit(2, f"compile_h100: unknown program {prog!r}; use some of {PROGRAMS}\n")
    args.sampler_tps = number_list(args.sampler_tps, "--sampler_tps", minimum=1, example="1,2")
    for flag in ("batch", "context_len", "chunk_steps", "fsdp", "tp", "rows", "seq_len"):
        at_least(getattr(args, flag), f"--{flag}")
    at_least(args.micro_batches, "--micro_batches")
    if args.quick:
        models = ["bench"]
        args.sampler_tps = [1, 2]
        args.batch, args.context_len, args.chunk_steps = 16, 256, 4
        args.rows, args.seq_len = 16, 256
    reason = gpu_compile.available()
    if reason:
        p.exit(2, f"compile_h100: cannot compile for a GPU here: {reason}\n")
    gpu = gpu_spec(args.gpu)
    suffix = "_quick" if args.quick else ""
    out = Path(args.out) if args.out else RESULTS_DIR / f"{gpu.name}_compile{suffix}.json"
    records = []
    t0 = time.perf_counter()
    for name in models:
        for rec in run_model(name, gpu, programs, args):
            print(summary_line(rec), flush=True)
            records.append(rec)
    payload = dict(
        format=gpu_compile.FORMAT,
        gpu=gpu.name,
        device_kind=gpu.device_kind,
        jax=jax.__version__,
        versions=_versions(),
        host=platform.platform(),
        date=datetime.datetime.now(datetime.UTC).isoformat(),
        command=" ".join(["python", *sys.argv]),
        total_s=round(time.perf_counter() - t0, 1),
        records=records,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(out)
    failed = [r for r in records if r.get("ok") is False]
    print(f"wrote {out}: {len(records)} records, {len(failed)} failed, {payload['total_s']} s")
    return 1 if failed else 0


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("jax", "jaxlib", "jax-cuda13-plugin", "flax", "jax-triton", "triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
