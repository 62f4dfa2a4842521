"""Each role on a GPU: memory per device and roofline step times, as lines to print.

One report, two callers: the planner's `--gpu` (gpu_plan.py, at the layout the Appendix A
search chose) and `launch.py --dry_run --gpu` (gpu_run.py, at a run config's layout). Both
pass plain shapes; neither decides here whether a role that does not fit is an error, since
the planner refuses before printing and the dry run prints first (`unfit_message` words both).
"""

from __future__ import annotations

import dataclasses
import math

from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.plan import gpu_memory, roofline
from pipelinerl_jax.plan.gpu_memory import GiB, Memory
from pipelinerl_jax.plan.gpu_specs import GpuSpec

NOT_MODELLED = (
    "not modelled: collectives (tensor-parallel all-reduces, FSDP gathers), weight "
    "transfer, kernel inefficiency; roofline times are lower bounds"
)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A sampler's shape: `replica_batch` sequences on each `tp`-device replica, each with KV
    room for `kv_len` tokens (or a pool of `kv_tokens` per replica), decode timed at mean
    context `decode_ctx`, in these dtypes."""

    tp: int
    replica_batch: float
    kv_len: int
    decode_ctx: float
    kv_tokens: int | None = None
    weight_dtype: str = "bfloat16"
    cache_dtype: str = "bfloat16"
    head_dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class RoleReport:
    sampler: Memory
    trainer: Memory
    lines: list[str]  # memory of each role, a decode step, a train step, what is left out


def role_report(
    gpu: GpuSpec,
    cfg: ModelConfig,
    sampling: Sampling,
    train: dict,
    *,
    train_devices: int,
    rows_held: int,
    attention_block: int = 128,
    records=(),
    model: str = "",
) -> RoleReport:
    """`train` is a profile 'train' section (gpu_profile.train_section) timing the step;
    the trainer's memory is for `rows_held` rows of its seq_len at once (a micro-batch's
    share per device) with parameters sharded over `train_devices`. `records`
    (gpu_memory.load_compiled) replace analytic memory where one matches `model`."""
    s = sampling
    common = dict(compiled=list(records), model=model, gpu=gpu.name)
    dtypes = dict(weight_dtype=s.weight_dtype, cache_dtype=s.cache_dtype, head_dtype=s.head_dtype)
    sampler = gpu_memory.memory_per_device(
        cfg,
        "sampler",
        **common,
        tp=s.tp,
        batch=math.ceil(s.replica_batch),
        context_len=s.kv_len,
        kv_tokens=s.kv_tokens,
        **dtypes,
    )
    seq_len = train["config"]["seq_len"]
    trainer = gpu_memory.memory_per_device(
        cfg,
        "trainer",
        **common,
        fsdp=train_devices,
        rows=rows_held,
        seq_len=seq_len,
        block=attention_block,
    )
    cost = roofline.decode_step_cost(
        cfg, batch=s.replica_batch, context_len=s.decode_ctx, tp=s.tp, **dtypes
    )
    one = roofline.decode_step_cost(cfg, batch=s.tp, context_len=s.decode_ctx, tp=s.tp, **dtypes)
    ms = [_fixed(roofline.seconds(c, gpu, s.weight_dtype) * 1e3, 2) for c in (cost, one)]
    conf = train["config"]
    lines = [
        sampler.describe(gpu),
        trainer.describe(gpu),
        f"decode step, predicted (roofline): {ms[0]} ms for {s.replica_batch:g} "
        f"sequences on {s.tp} device(s) ({roofline.bound(cost, gpu, s.weight_dtype)}-bound); "
        f"{ms[1]} ms at one sequence per device",
        f"train step, predicted (roofline): {_fixed(train['step_s'], 3)} s for {conf['rows']:g} x "
        f"{seq_len} tokens per device, FSDP over {conf['devices']} devices "
        f"({train['bound']}-bound): {train['tokens_per_s_per_device']:.0f} tokens/s per device",
        NOT_MODELLED,
    ]
    return RoleReport(sampler, trainer, lines)


def _fixed(value: float, decimals: int) -> str:
    """`decimals` places, or two significant digits where those would print zero (a toy
    model's step takes microseconds)."""
    return f"{value:.{decimals}f}" if value >= 10**-decimals else f"{value:.2g}"


def unfit_message(what: str, total: float, gpu: GpuSpec, fix: str) -> str:
    """`the sampler does not fit: X GiB per device, Y usable on h100; <fix>`."""
    return (
        f"the {what} does not fit: {total / GiB:.1f} GiB per device, "
        f"{gpu_memory.usable_bytes(gpu) / GiB:.1f} usable on {gpu.name}; {fix}"
    )
