"""The planner's `--gpu`: a predicted profile for a model on a GPU, the layout searched on it, and
what each role needs at that layout.

`setup` checks what the flags name (the GPU, the model, the KV reservation, the compile
records) with the planner's one-line messages; `plan_on_gpu` times the roles (gpu_profile.py),
runs the caller's Appendix A search on the predicted profile, times the training side again at
the split the search chose, and returns the profile, the search's result and the lines to print
before the plan table. Plain arguments only: __main__.py maps its flags onto them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pipelinerl_jax.models import config_json, param_counts
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.models.known_shapes import KNOWN_HF_CONFIGS, known_config
from pipelinerl_jax.plan import gpu_memory, gpu_profile, gpu_roles, model
from pipelinerl_jax.plan.gpu_specs import GPUS, GpuSpec, gpu_spec
from pipelinerl_jax.plan.utilisation import PlanError

COMPILE_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
# What to change when a role does not fit, in the planner's flags.
FIXES = {
    "sampler": "raise --sampler_tp or lower --context_len",
    "trainer": "give training more devices (raise --devices or lower --gen_devices) or "
    "lower --max_len",
}


@dataclasses.dataclass(frozen=True)
class GpuSetup:
    """What the --gpu flags name, checked: the GPU, the model, KV tokens a sequence reserves,
    the mean context a decoding token sees, and the compile records (maybe none)."""

    gpu: GpuSpec
    cfg: ModelConfig
    model: str
    sampler_tp: int
    kv_len: int
    mean_ctx: float
    records: list[dict]


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    profile: dict  # the predicted profile the final search ran on
    searched: tuple  # what `search` returned for it
    lines: list[str]  # printed before the plan table


def load_model_config(name: str) -> ModelConfig:
    """A known model's shapes (trainer dtypes: f32 params, bf16 compute, remat) or a config.json."""
    dtypes = dict(param_dtype="float32", compute_dtype="bfloat16", remat=True)
    if name.lower() in KNOWN_HF_CONFIGS:
        return known_config(name, **dtypes)
    path = Path(name) / "config.json" if Path(name).is_dir() else Path(name)
    if not path.is_file():
        raise PlanError(
            f"--model={name}: neither a known model {sorted(KNOWN_HF_CONFIGS)} nor a config.json"
        )
    try:
        return config_json.from_hf(json.loads(path.read_text()), **dtypes)
    except json.JSONDecodeError as e:
        raise PlanError(f"--model={name}: not valid JSON ({e.msg} at line {e.lineno})") from None


def mean_decode_context(dist: model.LengthDistribution) -> float:
    """A decoding token's mean context: a sequence of length l decodes at contexts 1..l, so
    E[l (l + 1) / 2] / E[l] (L / 3 for uniform lengths)."""
    lengths, probs = np.arange(1, dist.max_len + 1), np.asarray(dist.probs)
    return float(np.dot(probs, lengths * (lengths + 1) / 2) / np.dot(probs, lengths))


def setup(
    gpu: str,
    model_name: str | None,
    dist: model.LengthDistribution,
    *,
    sampler_tp: int = 1,
    context_len: int | None = None,
    compiled: str | None = None,
    profile_given: bool = False,
) -> GpuSetup:
    """The checked --gpu request (PlanError naming the flag if bad). context_len: KV tokens a
    sequence reserves (default the longest length); compiled: a compile record file (default
    bench/results/<gpu>_compile.json where it exists)."""
    try:
        spec = gpu_spec(gpu)
    except ValueError:
        raise PlanError(f"--gpu={gpu}: unknown GPU; use one of {sorted(GPUS)}") from None
    if profile_given:
        raise PlanError("--gpu predicts the profile: leave out --profile (or --gpu)")
    if not model_name:
        raise PlanError("--gpu needs --model=<known name or path to a config.json>")
    cfg = load_model_config(model_name)
    kv_len = context_len if context_len is not None else dist.max_len
    if kv_len < dist.max_len:
        raise PlanError(
            f"--context_len={kv_len}: shorter than the longest sequence ({dist.max_len}); "
            f"use --context_len >= {dist.max_len} or a shorter --max_len"
        )
    if kv_len > cfg.max_position_embeddings:
        raise PlanError(
            f"--context_len/--max_len {kv_len}: over {model_name}'s max_position_embeddings="
            f"{cfg.max_position_embeddings}; lower --max_len (and --context_len) to <= "
            f"{cfg.max_position_embeddings}"
        )
    path = compiled or str(COMPILE_RESULTS / f"{spec.name}_compile.json")
    if compiled and not Path(path).is_file():
        raise PlanError(f"--compiled={path}: no such file (bench/compile_h100.py writes it)")
    records = gpu_memory.load_compiled(path)
    return GpuSetup(spec, cfg, model_name, sampler_tp, kv_len, mean_decode_context(dist), records)


def predicted(s: GpuSetup, dist: model.LengthDistribution, batch: int, train_devices: int):
    """The predicted profile: training on packed rows of the longest length, the step's
    `batch` sequences spread over the training devices (at least one row each)."""
    devices = max(train_devices, 1)
    rows = max(1, math.ceil(batch * dist.mean_len / (devices * dist.max_len)))
    return gpu_profile.predicted_profile(
        s.cfg,
        s.gpu,
        context_len=s.mean_ctx,
        kv_context_len=s.kv_len,
        train_seq_len=dist.max_len,
        train_rows=rows,
        sampler_tp=s.sampler_tp,
        trainer_devices=devices,
        model=s.model,
        overhead_bytes=max(
            0.0,
            gpu_memory.sampler_overhead(
                s.cfg, s.records, model=s.model, gpu=s.gpu.name, tp=s.sampler_tp
            ),
        ),
    )


def report(s: GpuSetup, profile: dict, gen_batch: float, train_devices: int) -> list[str]:
    """Each role's memory and step time at the plan's layout (`gen_batch` sequences per
    generating device, `train_devices` training); PlanError if a role does not fit."""
    train = profile["train"]
    sampling = gpu_roles.Sampling(
        tp=s.sampler_tp,
        replica_batch=gen_batch * s.sampler_tp,
        kv_len=s.kv_len,
        decode_ctx=s.mean_ctx,
    )
    roles = gpu_roles.role_report(
        s.gpu,
        s.cfg,
        sampling,
        train,
        train_devices=train_devices,
        rows_held=train["config"]["rows"],
        records=s.records,
        model=s.model,
    )
    for mem in (roles.sampler, roles.trainer):
        if not mem.fits(s.gpu):
            raise PlanError(gpu_roles.unfit_message(mem.role, mem.total, s.gpu, FIXES[mem.role]))
    header = (
        f"predicted (roofline) for {s.model} ({param_counts.num_params(s.cfg) / 1e9:.2f}B params) on "
        f"{s.gpu.device_kind}; decode timed at a decoding token's mean context "
        f"{s.mean_ctx:.0f}, KV reserved for {s.kv_len} tokens a sequence"
    )
    return [header, *roles.lines]


def plan_on_gpu(
    s: GpuSetup,
    dist: model.LengthDistribution,
    *,
    devices: int,
    batch: int,
    gen_devices: int | None,
    search: Callable[[dict], tuple],
) -> GpuPlan:
    """`search(profile)` runs the layout search on a profile and returns a tuple whose third
    item is the layout.Plan and fourth a note on the units (the CLI's (device profile,
    workload, plan, note)). The training rate is first timed at the fixed or even split, then,
    if the search chose another, again at that split and the search rerun."""
    train_devices = devices - (gen_devices or devices // 2)
    profile = predicted(s, dist, batch, train_devices)
    searched = search(profile)
    if searched[2].train_devices != train_devices:  # time the optimizer's share at the split
        profile = predicted(s, dist, batch, searched[2].train_devices)
        searched = search(profile)
    plan, note = searched[2], searched[3]
    lines = report(s, profile, plan.gen_batch, plan.train_devices)
    lines.append(f"profile: predicted (roofline), {profile['source']}; {note}")
    return GpuPlan(profile, searched, lines)
