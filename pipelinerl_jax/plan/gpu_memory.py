"""Per-device memory of each GPU role: analytic items, or XLA's figures from compile records.

`memory_per_device` adds up what the sampler or the trainer holds per device (the analytic
items follow pipelinerl_jax/pipeline/memory.py's run estimate, split over devices), or takes the figures
that XLA's `memory_analysis()` reported for the same program compiled for the GPU
(bench/compile_h100.py writes the records; `load_compiled` reads them) when one exists. A role
"fits" when its total leaves RESERVE_FRACTION of the device for XLA's scratch.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from pipelinerl_jax.models import param_counts
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.pipeline import memory
from pipelinerl_jax.plan import roofline
from pipelinerl_jax.plan.gpu_specs import GpuSpec
from pipelinerl_jax.plan.utilisation import PlanError
from pipelinerl_jax.rl.config import LossConfig

GiB = 2**30
RESERVE_FRACTION = 0.1  # of device memory kept for XLA's scratch, as layout.kv_cache_max_batch
COMPILED_FORMAT = "pipelinerl_jax.gpu_compile/1"


@dataclasses.dataclass(frozen=True)
class Memory:
    """One role's bytes per device, by item, and where the figures came from."""

    role: str
    items: dict[str, int]
    source: str  # "analytic" or "compiled (<file>: <program> ...)"

    @property
    def total(self) -> int:
        return sum(self.items.values())

    def fits(self, gpu: GpuSpec) -> bool:
        return self.total <= usable_bytes(gpu)

    def describe(self, gpu: GpuSpec) -> str:
        """`<role>: fits in 80 GB: yes (X GiB per device: items...; source)`."""
        size = re.search(r"(\d+)GB", gpu.device_kind)
        label = f"{size.group(1)} GB" if size else f"{gpu.memory_bytes / GiB:.0f} GiB"
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.items.items() if v)
        return (
            f"{self.role}: fits in {label}: {'yes' if self.fits(gpu) else 'no'} "
            f"({self.total / GiB:.2f} GiB per device of {gpu.memory_bytes / GiB:.1f}, "
            f"{1 - RESERVE_FRACTION:.0%} usable: {parts}; {self.source})"
        )


def usable_bytes(gpu: GpuSpec) -> float:
    """What a role may hold per device: all but XLA's scratch reserve."""
    return gpu.memory_bytes * (1 - RESERVE_FRACTION)


def trainer_memory(cfg: ModelConfig, *, fsdp: int, rows: int, seq_len: int, block=128) -> dict:
    """The trainer's items per device: f32 master params, two f32 Adam moments, the f32 gradient
    and a compute-dtype copy, all sharded over `fsdp` devices; two layers gathered whole (the
    one computing and the next in flight); activations of `rows` rows of `seq_len` (memory.py:
    saved per remat policy, one layer's recomputed internals, the LM head's working set)."""
    P, E, c = param_counts.num_params(cfg), cfg.hidden_size, roofline.itemsize(cfg.compute_dtype)
    layer = roofline.layer_params(cfg) // cfg.num_layers * roofline.itemsize(cfg.param_dtype)
    H, D = cfg.num_heads, cfg.head_dim
    per_token = (E + H * D) * c + H * 4  # layer input, attention output, f32 log-sum-exp
    if cfg.remat_policy == "matmuls":
        per_token += (H * D + 2 * cfg.num_kv_heads * D + E + 2 * cfg.intermediate_size) * c
    if cfg.remat:
        saved = cfg.num_layers * rows * seq_len * per_token
        saved += memory.layer_internals_bytes(cfg, rows, seq_len, block)
    else:
        saved = (cfg.num_layers + 1) * memory.layer_internals_bytes(cfg, rows, seq_len, block)
    head = memory.head_working_bytes(cfg, rows * seq_len, LossConfig())
    return {
        "f32 master params": 4 * P // fsdp,
        "Adam moments": 8 * P // fsdp,
        "f32 gradients": 4 * P // fsdp,
        "compute copy": c * P // fsdp,
        "gathered layers": 2 * layer,
        "activations": saved + head,
    }


def sampler_memory(
    cfg: ModelConfig,
    *,
    tp: int,
    batch: int,
    context_len: int,
    cache_dtype: str = "bfloat16",
    weight_dtype: str = "bfloat16",
    head_dtype: str = "float32",
    kv_tokens: int | None = None,
) -> dict:
    """The sampler's items per device for `batch` sequences per tp-device replica, each with KV
    room for `context_len` tokens (every slot reserves its longest context, as the sampler's
    default pool does; `kv_tokens`: a pool of that many tokens per replica instead, as a run's
    sampler.num_pages or kv_memory_bytes sizes it): the decode copy of the weights, the next
    version's copy staged while the current one decodes, the KV pool and the f32 logits."""
    dtypes = dict(weight_dtype=weight_dtype, head_dtype=head_dtype)
    weights = roofline.sampler_weight_bytes(cfg, tp=tp, **dtypes)
    kv_heads = cfg.num_kv_heads // tp
    kv_token = 2 * cfg.num_layers * kv_heads * cfg.head_dim * roofline.itemsize(cache_dtype)
    return {
        "weights": weights,
        "staged next version": weights,
        "KV pool": (batch * context_len if kv_tokens is None else kv_tokens) * kv_token,
        "logits": batch * cfg.vocab_size * 4 // roofline.head_split(cfg, tp),
    }


def memory_per_device(
    cfg: ModelConfig, role: str, *, compiled=None, model: str = "", gpu: str = "", **shape
) -> Memory:
    """`role` "trainer" (shape: fsdp, rows, seq_len) or "sampler" (shape: tp, batch,
    context_len, dtypes): the analytic items, or a compiled record's figures when `compiled`
    (load_compiled's records) holds one for the same gpu, model, program and device count."""
    if role == "trainer":
        program, devices = "train_step", shape["fsdp"]
        analytic = trainer_memory(cfg, **shape)
    elif role == "sampler":
        program, devices = "decode_chunk", shape["tp"]
        analytic = sampler_memory(cfg, **shape)
    else:
        raise PlanError(f"memory_per_device: role {role!r} is neither 'trainer' nor 'sampler'")
    want = (
        {"rows": shape["rows"], "seq_len": shape["seq_len"]}
        if role == "trainer"
        else {"batch": shape["batch"], "context_len": shape["context_len"]}
    )
    rec = compiled_record(
        compiled or [], model=model, program=program, devices=devices, gpu=gpu, shapes=want
    )
    if rec is None:
        return Memory(role, analytic, "analytic")
    got = rec.get("shapes", {})
    where = rec.get("_path", "compile records")
    at = ", ".join(f"{k} {v}" for k, v in sorted(got.items()))
    if any(got.get(k) != v for k, v in want.items()):
        return _calibrated(cfg, role, analytic, rec, shape, f"{where}: {program} at {at}")
    m = rec["memory"]
    items = {
        "arguments": m["argument_bytes"],
        "outputs": m["output_bytes"] - m["alias_bytes"],
        "temporaries": m["temp_bytes"],
    }
    if role == "sampler":  # the program decodes; the next version waits beside it
        items["staged next version (analytic)"] = analytic["staged next version"]
    return Memory(role, items, f"compiled ({where}: {program} on {devices} devices at {at})")


def _calibrated(cfg, role, analytic: dict, rec: dict, shape: dict, what: str) -> Memory:
    """A compiled record at other shapes: the analytic items at the plan's shapes, plus what
    the compiler added over the analytic sum at the record's own shapes. The record's program
    holds no staged next version, and its LM head is in the compute dtype (gpu_compile.py).
    Trainer records are taken only at the plan's shapes (their rows are global, per step)."""
    if role != "sampler":
        return Memory(role, analytic, f"analytic (a compiled record is for other shapes: {what})")
    got = rec["shapes"]
    at_record = dict(shape, batch=got["batch"], context_len=got["context_len"], kv_tokens=None)
    at_record.update(weight_dtype=rec["dtype"], cache_dtype=rec["dtype"], head_dtype=rec["dtype"])
    expected = sampler_memory(cfg, **at_record)
    expected_total = sum(expected.values()) - expected["staged next version"]
    compiled = rec["memory"]["peak_bytes"]
    items = dict(analytic)
    items["compiler's excess over analytic"] = compiled - expected_total
    return Memory(
        role,
        items,
        f"analytic, calibrated by a compiled record ({what}: compiled {compiled / GiB:.2f} GiB "
        f"vs analytic {expected_total / GiB:.2f} there)",
    )


def sampler_overhead(cfg: ModelConfig, records, *, model: str, gpu: str, tp: int) -> float:
    """What the compiler adds over the analytic sampler items (bytes per device), read off a
    compile record of this model's decode chunk on `tp` devices; 0 without one."""
    rec = compiled_record(records or [], model=model, program="decode_chunk", devices=tp, gpu=gpu)
    if rec is None:
        return 0.0
    shape = dict(tp=tp, batch=rec["shapes"]["batch"], context_len=rec["shapes"]["context_len"])
    mem = _calibrated(cfg, "sampler", {}, rec, shape, "")
    return float(mem.items["compiler's excess over analytic"])


def load_compiled(path: str | Path) -> list[dict]:
    """The successful records of a `pipelinerl_jax.gpu_compile/1` file, each tagged with its
    path and the file's gpu; [] when the file does not exist."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except json.JSONDecodeError as e:
        raise PlanError(f"--compiled={path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != COMPILED_FORMAT:
        raise PlanError(
            f"--compiled={path}: not a compile record file (expected format "
            f"{COMPILED_FORMAT!r}, as bench/compile_h100.py writes)"
        )
    out = []
    for rec in data.get("records", []):
        if rec.get("ok") and isinstance(rec.get("memory"), dict) and "peak_bytes" in rec["memory"]:
            out.append({"gpu": data.get("gpu", ""), **rec, "_path": str(path)})
    return out


def compiled_record(
    records, *, model: str, program: str, devices: int, gpu: str = "", shapes=None
) -> dict | None:
    """A record of `program` for `model` on `devices` devices (and `gpu` when given): the first
    whose shapes include every item of `shapes`, else the first at any shapes."""
    found = [
        rec
        for rec in records
        if rec.get("program") == program
        and str(rec.get("model", "")).lower() == model.lower()
        and rec.get("devices") == devices
        and (not gpu or str(rec.get("gpu", "")).lower() == gpu.lower())
    ]
    want = shapes or {}
    for rec in found:
        if all(rec.get("shapes", {}).get(k) == v for k, v in want.items()):
            return rec
    return found[0] if found else None
