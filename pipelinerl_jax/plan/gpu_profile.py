"""The planner profile predicted for a GPU: roofline decode and train times in `plan measure`'s
format.

`predicted_profile` turns roofline.py's step times into the profile's 'decode' and 'train'
sections (the format `plan measure` writes), marked predicted, so the Appendix A search
(layout.py) runs on them in place of a measured U(h). The decode curve stops at the KV bound
(layout.kv_cache_max_batch) with two weight copies held, the decoding one and the next staged.
"""

from __future__ import annotations

import math

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import param_counts
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.plan import gpu_memory, roofline
from pipelinerl_jax.plan.gpu_specs import GpuSpec
from pipelinerl_jax.plan.layout import kv_cache_max_batch
from pipelinerl_jax.plan.utilisation import PlanError
from pipelinerl_jax.sampler.forward import check_tp


def predicted_profile(
    cfg: ModelConfig,
    gpu: GpuSpec,
    *,
    context_len: float,
    kv_context_len: int | None = None,
    batch_sizes=None,
    train_seq_len: int = 1024,
    train_rows: int = 1,
    sampler_tp: int = 1,
    trainer_devices: int = 1,
    cache_dtype: str = "bfloat16",
    weight_dtype: str = "bfloat16",
    head_dtype: str = "float32",
    model: str = "",
    overhead_bytes: float = 0.0,
) -> dict:
    """Profile 'decode' and 'train' sections (utilisation.decode_curve_from_profile and the CLI's
    device_profile read them) from the roofline, marked `"predicted": true`.

    Decode: batch_sizes are per-device batches h; a replica of `sampler_tp` devices decodes
    h x tp sequences at mean context `context_len`, so latency_s(h) is its step time. The KV
    bound (layout.kv_cache_max_batch) reserves `kv_context_len` tokens (default context_len)
    per sequence beside two weight copies (current and staged); default batch_sizes are the
    powers of two up to that bound, plus the bound. Train: `train_rows` rows of `train_seq_len`
    per device per step on `trainer_devices` FSDP devices, under cfg's remat setting.
    """
    tp = sampler_tp
    if tp < 1:
        raise PlanError(f"--sampler_tp={tp}: must be at least 1 device per sampler")
    try:
        check_tp(cfg, tp)
    except ConfigError as e:  # names the dimension that does not split; the flag is ours
        raise PlanError(f"--sampler_tp={tp}: {e}") from None
    weights = roofline.sampler_weight_bytes(
        cfg, tp=tp, weight_dtype=weight_dtype, head_dtype=head_dtype
    )
    kv_len = int(kv_context_len or math.ceil(context_len))
    try:
        per_replica = kv_cache_max_batch(
            memory_bytes=gpu.memory_bytes,
            param_bytes=2 * weights,  # the decoding version and the next one, staged
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads // tp,
            head_dim=cfg.head_dim,
            context_len=kv_len,
            bytes_per_element=roofline.itemsize(cache_dtype),
            reserve_fraction=gpu_memory.RESERVE_FRACTION,
        )
    except PlanError as e:
        raise PlanError(f"sampler with --sampler_tp={tp}: {e} (raise --sampler_tp)") from None
    # The bound counts K/V and weights only; the fit check (gpu_memory) also counts the f32
    # logits and, with a compile record, the compiler's excess (`overhead_bytes`): step the
    # bound down until the same accounting fits, so the plan never picks a batch it refuses.
    dtypes = dict(cache_dtype=cache_dtype, weight_dtype=weight_dtype, head_dtype=head_dtype)
    while per_replica > 1:
        held = gpu_memory.sampler_memory(
            cfg, tp=tp, batch=per_replica, context_len=kv_len, **dtypes
        )
        if sum(held.values()) + overhead_bytes <= gpu_memory.usable_bytes(gpu):
            break
        per_replica -= 1
    max_h = per_replica / tp
    if batch_sizes is None:
        batch_sizes = [2**i for i in range(30) if 2**i <= max_h]
        batch_sizes = sorted(set(batch_sizes) | {math.floor(max_h)} - {0}) or [max_h]
    costs = [
        roofline.decode_step_cost(cfg, batch=h * tp, context_len=context_len, tp=tp, **dtypes)
        for h in batch_sizes
    ]
    source = (
        f"roofline: {gpu.name} peaks ({gpu.bf16_flops / 1e12:g} TFLOP/s bf16, "
        f"{gpu.hbm_bytes_per_s / 1e12:g} TB/s HBM), predicted from shapes, not measured"
    )
    shape_fields = ("num_layers", "hidden_size", "num_kv_heads", "head_dim", "vocab_size")
    desc = {"source": model or cfg.model_type, **{k: getattr(cfg, k) for k in shape_fields}}
    desc |= {
        "params": param_counts.num_params(cfg),
        "dtype": weight_dtype,
    }  # as engine_probe describes it
    decode = {
        "batch_sizes": list(batch_sizes),
        "latency_s": [roofline.seconds(c, gpu, weight_dtype) for c in costs],
        "bound": [roofline.bound(c, gpu, weight_dtype) for c in costs],
        "context_len": context_len,
        "kv_context_len": kv_len,
        "sampler_tp": tp,
        "statistic": "roofline",
        "model": desc,
        "kv_max_batch": max_h,
        "memory_bytes": gpu.memory_bytes,
        "predicted": True,
    }
    train = train_section(
        cfg, gpu, rows=train_rows, seq_len=train_seq_len, devices=trainer_devices
    ) | {"model": dict(desc, dtype=cfg.compute_dtype), "predicted": True}
    head = dict(backend="gpu", device_kind=gpu.device_kind, predicted=True, source=source)
    return head | {"decode": decode, "train": train}


def train_section(
    cfg: ModelConfig,
    gpu: GpuSpec,
    *,
    rows: float,
    seq_len: int,
    devices: int,
    micro_batches: int = 1,
    attention_block: int = 128,
) -> dict:
    """The profile's 'train' timing: `rows` packed rows of `seq_len` per device per step on
    `devices` FSDP devices, under cfg's remat setting (the planner and launch.py --dry_run
    --gpu both time the trainer through here)."""
    cost = roofline.train_step_cost(
        cfg,
        tokens=rows * seq_len * devices,
        seq_len=seq_len,
        remat=cfg.remat,
        devices=devices,
        micro_batches=micro_batches,
        attention_block=attention_block,
    )
    step_s = roofline.seconds(cost, gpu, cfg.compute_dtype)
    config = dict(rows=rows, seq_len=seq_len, devices=devices)
    config |= dict(remat=cfg.remat, remat_policy=cfg.remat_policy, statistic="roofline")
    return {  # packed tokens; the plan counts them as generated ones (prompts not modelled)
        "tokens_per_s_per_device": rows * seq_len / step_s,
        "packed_tokens_per_s": rows * seq_len / step_s,
        "step_s": step_s,
        "bound": roofline.bound(cost, gpu, cfg.compute_dtype),
        "config": config,
    }
