"""A run config's roles on a GPU: what `launch.py --dry_run --gpu=h100` prints.

The run config fixes everything the planner's `--gpu` searches for: the sampler's slots, KV
pool and context (config.sampler), the packed batch (config.batch: rows of seq_len per step,
in trainer.micro_batches micro-batches) and the devices each role gets (the dry run's own split
of this machine's devices, `pipeline.components.split_devices`). `gpu_report` hands those
shapes to the planner's report (gpu_roles.py: memory per device and roofline step times,
predicted, never measured) and says which role, if any, would not fit. Memory is analytic: the
compile records name known checkpoints in bf16, not a run's model and dtypes.
"""

from __future__ import annotations

import dataclasses
import math

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import param_counts
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.plan import gpu_profile, gpu_roles
from pipelinerl_jax.plan.gpu_memory import Memory
from pipelinerl_jax.plan.gpu_specs import GPUS, GpuSpec, gpu_spec
from pipelinerl_jax.sampler import pages as pg
from pipelinerl_jax.sampler.forward import check_tp

# What to change in the run config when a role does not fit.
FIXES = {
    "sampler": "lower config.sampler.num_slots, max_seq_len or num_pages, or raise "
    "config.devices.sampler_tp",
    "trainer": "raise config.trainer.micro_batches, turn on config.model.remat, or give the "
    "trainer more devices",
    "sampler + trainer": "run on more devices (each role then gets its own) or shrink a role",
}


@dataclasses.dataclass(frozen=True)
class GpuRunReport:
    lines: list[str]  # printed after the dry run's own lines
    problem: str | None  # the first role that does not fit, in one line; None: all fit


def gpu_for_flag(name: str) -> GpuSpec:
    """The GPU --gpu names; ConfigError listing the known ones otherwise."""
    try:
        return gpu_spec(name)
    except ValueError:
        raise ConfigError(f"--gpu={name}: unknown GPU; use one of {sorted(GPUS)}") from None


def kv_pool_tokens(cfg, model_cfg: ModelConfig, shards: int) -> int:
    """KV tokens one data shard (a tp-device replica) holds, the pool as PagedSampler.__init__
    sizes it: num_pages, or kv_memory_bytes' worth, or room for max_seq_len in every slot."""
    pool = pg.sampler_pool(cfg.sampler, model_cfg, shards=shards)
    return pool.num_pages // shards * pool.page_size


def gpu_report(
    cfg,
    model_cfg: ModelConfig,
    gpu: GpuSpec,
    *,
    sampler_devices: int,
    trainer_devices: int,
    shared: bool = False,
) -> GpuRunReport:
    """The run `cfg` (a RunConfig) of `model_cfg` with this many devices per role on `gpu`;
    `shared`: one device serves both roles (a one-device run), so their sum must fit too."""
    tp = cfg.devices.sampler_tp
    check_tp(model_cfg, tp)
    shards = max(sampler_devices // tp, 1)
    s = cfg.sampler
    compute = s.compute_dtype or model_cfg.compute_dtype  # what the sampler decodes in
    # A decoding token's context if every prompt is full length and every completion runs to
    # max_new_tokens: the prompt plus, on average, half the completion.
    decode_ctx = min(s.max_seq_len, cfg.max_prompt_tokens + cfg.max_new_tokens / 2)
    sampling = gpu_roles.Sampling(
        tp=tp,
        replica_batch=math.ceil(s.num_slots / shards),
        kv_len=s.max_seq_len,
        decode_ctx=decode_ctx,
        kv_tokens=kv_pool_tokens(cfg, model_cfg, shards),
        weight_dtype=compute,  # the sampler decodes a copy in its compute dtype (memory.py)
        cache_dtype=pg.cache_dtype(s, model_cfg),
        head_dtype=s.head_dtype or "float32",
    )
    b, micro = cfg.batch, cfg.trainer.micro_batches
    rows = b.num_rows // trainer_devices if b.num_rows % trainer_devices == 0 else None
    train = gpu_profile.train_section(
        model_cfg,
        gpu,
        rows=rows if rows is not None else b.num_rows / trainer_devices,
        seq_len=b.seq_len,
        devices=trainer_devices,
        micro_batches=micro,
        attention_block=cfg.trainer.attention_block,
    )
    data_groups = max(trainer_devices // cfg.devices.trainer_tp, 1)  # rows split over these
    roles = gpu_roles.role_report(
        gpu,
        model_cfg,
        sampling,
        train,
        train_devices=trainer_devices,
        rows_held=math.ceil(b.num_rows / micro / data_groups),
        attention_block=cfg.trainer.attention_block,
    )
    where = (
        "one device shared by sampler and trainer"
        if shared
        else f"{sampler_devices} sampler + {trainer_devices} trainer devices"
    )
    header = [
        f"--gpu={gpu.name}: predicted (roofline) on {gpu.device_kind} for this run "
        f"({param_counts.num_params(model_cfg):,} parameters, {compute} compute) on {where}",
        f"layout: sampler {shards} replica(s) of tp {tp}, {sampling.replica_batch} slots and "
        f"{sampling.kv_tokens} KV tokens each, decode timed at context {decode_ctx:g} (a full "
        f"prompt plus half of max_new_tokens); trainer {b.num_rows} rows of {b.seq_len} tokens "
        f"a step in {micro} micro-batch(es)",
    ]
    mems = [roles.sampler, roles.trainer]
    lines = [*header, *roles.lines]
    if shared:  # both roles in one device's memory
        both = {"sampler": roles.sampler.total, "trainer": roles.trainer.total}
        mems.append(Memory("sampler + trainer", both, "analytic, one device"))
        lines.insert(4, mems[-1].describe(gpu))
    unfit = [m for m in mems if not m.fits(gpu)]
    problem = None
    if unfit:
        m = unfit[0]
        problem = f"--gpu={gpu.name}: " + gpu_roles.unfit_message(
            m.role, m.total, gpu, FIXES[m.role]
        )
    return GpuRunReport(lines, problem)
