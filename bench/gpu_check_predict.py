"""bench/gpu_check.py's models and roofline predictions, and its `predictions` stage.

Every decode and train row records pipelinerl_jax.plan.roofline's prediction beside the
measurement. The roofline is another engineer's module and may be missing or have another
signature on the day: each prediction then records "prediction unavailable: <error>" and the
stage still measures. Imports are lazy: `gpu_check.py --help` must work without JAX.
"""

from __future__ import annotations

import dataclasses
import inspect

from bench.gpu_check_harness import Check, Skip, Stage
from pipelinerl_jax.models import param_counts


def model_config(name: str, rehearsal: bool, **dtypes):
    """The ModelConfig of a model name: "bench" (bench/common.BENCH_MODEL), "tiny" (its quick
    shape), or a known_shapes name; `dtypes`: param_dtype, compute_dtype, remat, remat_policy."""
    from bench import common
    from pipelinerl_jax.models.known_shapes import known_config

    if name in ("bench", "tiny"):
        cfg = common.bench_model_config(quick=name == "tiny" or rehearsal)
        return dataclasses.replace(cfg, **dtypes)
    return known_config(name, **dtypes)


def pick_gpu(device_kind: str):
    """The planner's GpuSpec for this device: H200 when the kind says so, else H100 (also the
    reference the CPU rehearsal's figures are set against)."""
    from pipelinerl_jax.plan.gpu_specs import gpu_spec

    return gpu_spec("h200" if "h200" in device_kind.lower() else "h100")


def _roofline():
    """The roofline module, or (None, "prediction unavailable: <error>")."""
    try:
        from pipelinerl_jax.plan import roofline

        for fn in ("decode_step_cost", "train_step_cost", "seconds"):
            getattr(roofline, fn)
        return roofline, None
    except Exception as e:  # noqa: BLE001 - another engineer's module may be missing or broken
        return None, f"prediction unavailable: {type(e).__name__}: {e}"


def predict_decode(cfg, gpu, *, batch: int, context_len: float) -> dict:
    """Roofline decode-step time and tokens/s (bf16 weights, cache and head), or the reason."""
    rf, why = _roofline()
    if rf is None:
        return {"unavailable": why}
    try:
        kwargs = dict(
            batch=batch,
            context_len=context_len,
            cache_dtype="bfloat16",
            weight_dtype="bfloat16",
            tp=1,
        )
        if "head_dtype" in inspect.signature(rf.decode_step_cost).parameters:
            kwargs["head_dtype"] = "bfloat16"  # as our sampler runs here (SamplerConfig)
        cost = rf.decode_step_cost(cfg, **kwargs)
        step_s = rf.seconds(cost, gpu, "bfloat16")
        out = {"step_s": step_s, "tok_s": batch / step_s, "flops": cost.flops}
        out["bytes"] = cost.bytes
        if hasattr(rf, "bound"):
            out["bound"] = rf.bound(cost, gpu, "bfloat16")
        return out
    except Exception as e:  # noqa: BLE001 - a changed signature is recorded, not fatal
        return {"unavailable": f"prediction unavailable: {type(e).__name__}: {e}"}


def predict_train(cfg, gpu, *, tokens: int, seq_len: int, remat: bool) -> dict:
    """Roofline train-step time and tokens/s on one device (bf16 compute), or the reason."""
    rf, why = _roofline()
    if rf is None:
        return {"unavailable": why}
    try:
        cost = rf.train_step_cost(cfg, tokens=tokens, seq_len=seq_len, remat=remat, devices=1)
        step_s = rf.seconds(cost, gpu, "bfloat16")
        out = {"step_s": step_s, "tok_s": tokens / step_s, "flops": cost.flops}
        out["bytes"] = cost.bytes
        if hasattr(rf, "bound"):
            out["bound"] = rf.bound(cost, gpu, "bfloat16")
        return out
    except Exception as e:  # noqa: BLE001
        return {"unavailable": f"prediction unavailable: {type(e).__name__}: {e}"}


def train_flops_per_token(cfg, seq_len: int) -> float:
    """Model FLOPs per trained token (the MFU numerator): 6 x the matmul weights a token meets
    (forward 2, backward 4; the LM head included, the embedding lookup is no matmul) plus causal
    attention, 6 L H D seq_len (q k^T and p v, 4 H D per key, over seq_len / 2 keys on average,
    times 3 for forward and backward). Remat's recomputation is not counted: MFU, not HFU."""
    attention = 6.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return 6.0 * param_counts.matmul_params_per_token(cfg) + attention


def stage_predictions(ctx: Stage, check: Check, gpu) -> None:
    """Measured beside predicted for every decode and train row, as one table."""
    rf, why = _roofline()
    ctx.rec["roofline"] = "available" if rf is not None else why
    ctx.rec["gpu"] = gpu.name
    table = []
    stages = check.record["stages"]
    for row in stages.get("decode", {}).get("rows", []):
        pred = row.get("predicted", {})
        table.append(
            dict(
                what="decode tok/s",
                model=row["model"],
                shape=f"batch {row['batch']}",
                measured=row.get("ours_tok_s"),
                predicted=pred.get("tok_s", pred.get("unavailable")),
                measured_over_predicted=row.get("ours_frac_of_predicted"),
                bound=pred.get("bound"),
            )
        )
    for row in stages.get("train", {}).get("rows", []):
        pred = row.get("predicted", {})
        for what, key in (("train tok/s", "tok_s"), ("train MFU", "mfu")):
            measured, predicted = row.get(key), pred.get(key, pred.get("unavailable"))
            ratio = (
                measured / predicted
                if isinstance(measured, float) and isinstance(predicted, float)
                else None
            )
            table.append(
                dict(
                    what=what,
                    model=row["model"],
                    shape=f"{row['rows']}x{row['seq_len']}",
                    measured=measured,
                    predicted=predicted,
                    measured_over_predicted=ratio,
                    bound=pred.get("bound"),
                )
            )
    ctx.rec["table"] = table
    if not table:
        raise Skip("no decode or train measurement to set predictions beside")
    from bench import common

    common.print_table(
        table, ["what", "model", "shape", "measured", "predicted", "measured_over_predicted"]
    )
