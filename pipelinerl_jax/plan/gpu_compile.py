"""The project's GPU programs compiled for an NVIDIA topology on a machine with no GPU.

`jax.experimental.topologies.get_topology_desc(name, "cuda", target_config=..., topology=
"1x1xN")` gives N devices of a GPU described by an XLA target config (plan/gpu_specs.py). A
mesh over them lets `jax.jit(f).lower(abstract inputs).compile()` run here, with XLA's GPU
compiler, so each program is checked and measured before anyone rents a GPU:

  decode_chunk   the sampler's k-step decode (sampler/steps.py) with the `paged` strategy: the
                 Triton kernel really in the program (kernels/target.py tells the dispatch and
                 jax-triton that the target is sm_90), tensor-parallel over `tp` devices;
  train_step     the Trainer's jitted step (trainer.py), FSDP x TP, f32 params, f32 or bf16
                 compute, remat and micro-batches as the run config sets them;
  publish_gather the trainer-side half of a weight publish: the trainer's FSDP x TP params
                 narrowed to what decoding reads (bf16 layers: sampler/forward.py
                 publish_dtypes) and re-laid as the sampler's input layout (the all-gather
                 the copy needs);
  publish_prepare the sampler-side half: steps.prepare_params, model params on the sampler
                 mesh -> the decode layout (cast to the compute dtype, per-layer views).
                 Between them `jax.device_put` copies the params across meshes: no compiled
                 program, so its bytes are recorded for the planner.

Each record holds the compiled program's per-device memory (`memory_analysis()`), whether the
Triton kernel's custom call is in the optimised HLO, and the FLOPs and bytes of the roofline
model (plan/roofline.py): without a device, XLA's GPU cost analysis returns nothing.

Needs jax >= 0.11 with the CUDA plugin (`jax-cuda13-plugin`, `jax-cuda13-pjrt`; no NVIDIA
library wheels) and, for the kernel, jax-triton 0.3.1 with triton; `available()` says what is
missing. The plugin refuses to load without the CUDA libraries unless
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1, which `topology` sets (compiling needs none of them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from pipelinerl_jax import sharding
from pipelinerl_jax.kernels import target
from pipelinerl_jax.models import decoder
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.plan.gpu_specs import GpuSpec
from pipelinerl_jax.rl.batch import SEQUENCE_FIELDS, TOKEN_FIELDS, TrainBatch
from pipelinerl_jax.rl.config import LossConfig
from pipelinerl_jax.sampler import engine as eng
from pipelinerl_jax.sampler import forward as fwd
from pipelinerl_jax.sampler import steps
from pipelinerl_jax.sampler.param_view import input_shardings
from pipelinerl_jax.train.config import TrainerConfig
from pipelinerl_jax.train.trainer import Trainer, TrainState, trainer_mesh

__all__ = [
    "new_record",
    "FORMAT",
    "GpuCompileUnavailable",
    "available",
    "compile_decode_chunk",
    "compile_publish",
    "compile_train_step",
    "topology",
]

FORMAT = "pipelinerl_jax.gpu_compile/1"
# Autotuning runs candidate kernels on a device; there is none.
COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}
TRITON_CALL_TARGETS = ("triton_kernel_call",)  # jax-triton's custom-call target name(s)
_INT_FIELDS = {"tokens", "positions", "segment_ids", "prefix_ids", "targets", "versions"}
_INT_FIELDS |= {"sequence_index", "group_ids", "completion_lengths"}


class GpuCompileUnavailable(RuntimeError):
    """This environment cannot compile for an NVIDIA GPU; the message says what is missing."""


def available() -> str | None:
    """None when GPU programs can be compiled here, else a one-line reason."""
    major_minor = tuple(int(x) for x in jax.__version__.split(".")[:2])
    if major_minor < (0, 11):
        return f"jax {jax.__version__} here; compiling for a GPU topology is set up for jax 0.11"
    if not any(
        importlib.util.find_spec(name) for name in ("jax_cuda13_plugin", "jax_cuda12_plugin")
    ):
        return "the jax CUDA plugin is not installed (make compile-h100 installs it)"
    return None


@functools.cache
def topology(gpu: GpuSpec, num_devices: int) -> tuple:
    """`num_devices` abstract devices of `gpu` (one host), to build meshes over."""
    reason = available()
    if reason:
        raise GpuCompileUnavailable(reason)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(
        gpu.name, "cuda", target_config=gpu.target_config(), topology=f"1x1x{num_devices}"
    )
    return tuple(desc.devices)


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    out = dict(
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes),
        temp_bytes=int(m.temp_size_in_bytes),
        generated_code_bytes=int(m.generated_code_size_in_bytes),
    )
    out["peak_bytes"] = (
        out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    )
    return out


def _xla_cost(compiled) -> dict | None:
    """XLA's own figures, where the deviceless compile gives any (it gave none on jax 0.11.2)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001  (an unimplemented analysis is an answer: none)
        return None
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    if not cost:
        return None
    return {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost}


def _compile(lower, gpu: GpuSpec, record: dict) -> dict:
    """Lowers and compiles under the GPU target; fills `record` (ok, error, memory, timings)."""
    t0 = time.perf_counter()
    try:
        with target.compiling_for("gpu", gpu.compute_capability), _xla_log() as log:
            lowered = lower()
            compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
    except Exception as err:  # noqa: BLE001  (recorded: a failed compile is a result)
        record.update(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:400]}")
        record["compile_s"] = round(time.perf_counter() - t0, 2)
        return record
    hlo = compiled.as_text()
    record.update(
        ok=True,
        error=None,
        compile_s=round(time.perf_counter() - t0, 2),
        memory=_memory(compiled),
        triton_kernel=any(f'custom_call_target="{t}' in hlo for t in TRITON_CALL_TARGETS),
        collectives=sorted(
            op for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all") if op in hlo
        ),
        xla_cost=_xla_cost(compiled),
        # The SPMD partitioner's "cannot go from sharding A to B efficiently": a tensor
        # replicated whole, then re-split; each is a layout worth fixing on the GPU.
        involuntary_remats=log.text.count("Involuntary full rematerialization"),
    )
    return record


class _Captured:
    text = ""


@contextlib.contextmanager
def _xla_log():
    """XLA's C++ warnings during the block (they go to file descriptor 2, not to Python's
    logging), echoed to stderr afterwards and kept in `.text`."""
    captured = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.text = tmp.read().decode(errors="replace")
            sys.stderr.write(captured.text)


def new_record(program, model, gpu, devices, layout, shapes=None, dtype=None) -> dict:
    """The fields every record starts with (bench/compile_h100.py adds its skips with it)."""
    return dict(
        program=program,
        model=model,
        gpu=gpu.name,
        devices=devices,
        layout=layout,
        shapes=shapes,
        dtype=dtype,
    )


# --- the sampler ----------------------------------------------------------------------------


def sampler_engine(cfg: ModelConfig, devices, *, batch: int, context_len: int, page_size: int):
    """The Engine a GPU sampler of this size builds: `paged` attention, bf16 cache and head,
    one data shard and tensor parallelism over `devices`."""
    pages_per_slot = -(-context_len // page_size)
    ecfg = steps.EngineConfig(
        num_slots=batch,
        page_size=page_size,
        num_pages=batch * pages_per_slot + 1,  # every slot's full context, plus the null page
        pages_per_slot=pages_per_slot,
        max_stop_tokens=4,
        cache_dtype=cfg.compute_dtype,
        head_dtype=cfg.compute_dtype,
        attention="paged",
    )
    mesh = sharding.make_mesh((1, len(devices)), ("data", "tp"), devices)
    graphdef, _ = decoder.abstract_init(cfg)
    return eng.Engine(graphdef, ecfg, mesh)


def _decode_params(engine):
    prepare = functools.partial(steps.prepare_params, cfg=engine.model_cfg, ecfg=engine.ecfg)
    shapes = jax.eval_shape(prepare, decoder.abstract_init(engine.model_cfg)[1])
    return _abstract(shapes, engine.param_shardings)


def compile_decode_chunk(
    cfg: ModelConfig,
    gpu: GpuSpec,
    *,
    model: str,
    tp: int = 1,
    batch: int = 64,
    context_len: int = 2048,
    chunk_steps: int = 16,
    page_size: int = 16,
) -> dict:
    """One decode chunk of `chunk_steps` steps, `batch` slots, every slot's window covering
    `context_len` tokens (the longest the pool holds), params and cache in cfg.compute_dtype."""
    record = new_record(
        "decode_chunk",
        model,
        gpu,
        tp,
        dict(tp=tp, data=1, attention="paged"),
        dict(batch=batch, context_len=context_len, chunk_steps=chunk_steps, page_size=page_size),
        cfg.compute_dtype,
    )

    def lower():
        engine = sampler_engine(
            cfg, topology(gpu, tp), batch=batch, context_len=context_len, page_size=page_size
        )
        state = jax.eval_shape(
            functools.partial(steps.empty_state, cfg, engine.ecfg, chunk_steps=chunk_steps)
        )
        version = jax.ShapeDtypeStruct((), jnp.int32, sharding=engine.replicated)
        window = engine.ecfg.pages_per_slot
        return engine.decode_chunk.lower(
            _decode_params(engine),
            _abstract(state, engine.shardings),
            version,
            k=chunk_steps,
            window=window,
        )

    return _compile(lower, gpu, record)


# --- the trainer ----------------------------------------------------------------------------


def trainer_for(cfg: ModelConfig, devices, *, tp: int, micro_batches: int, head_dtype: str):
    """The Trainer a GPU run of this layout builds (f32 master params: cfg.param_dtype)."""
    graphdef, abstract_params = decoder.abstract_init(cfg)
    tcfg = TrainerConfig(micro_batches=micro_batches, loss=LossConfig(head_dtype=head_dtype))
    return Trainer(tcfg, graphdef, abstract_params, trainer_mesh(devices, tp=tp))


def _train_state(trainer: Trainer):
    abstract_params = decoder.abstract_init(decoder.config_of(trainer.graphdef))[1]
    opt = jax.eval_shape(lambda p: trainer.tx.init(jax.tree.map(_f32_leaf, p)), abstract_params)
    repl = sharding.replicated(trainer.mesh)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=repl)
    return TrainState(
        step=scalar,
        version=scalar,
        params=_abstract(abstract_params, trainer.param_shardings),
        opt_state=_abstract(opt, trainer.opt_shardings),
        ref_params=None,
        skipped=scalar,
        consecutive_skips=scalar,
    )


def _f32_leaf(x):
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _train_batch(trainer: Trainer, rows: int, seq_len: int):
    shardings = trainer.batch_shardings()
    fields = {}
    for name in TOKEN_FIELDS:
        dtype = jnp.int32 if name in _INT_FIELDS else jnp.float32
        fields[name] = jax.ShapeDtypeStruct(
            (rows, seq_len), dtype, sharding=getattr(shardings, name)
        )
    for name in SEQUENCE_FIELDS:
        dtype = jnp.int32 if name in _INT_FIELDS else jnp.float32
        fields[name] = jax.ShapeDtypeStruct((rows,), dtype, sharding=getattr(shardings, name))
    return TrainBatch(**fields)


def compile_train_step(
    cfg: ModelConfig,
    gpu: GpuSpec,
    *,
    model: str,
    fsdp: int = 4,
    tp: int = 2,
    rows: int = 32,
    seq_len: int = 1024,
    micro_batches: int = 4,
) -> dict:
    """One optimizer step over `rows` packed rows of `seq_len` tokens (one sequence a row),
    FSDP x TP over fsdp * tp devices, in `micro_batches` accumulation steps."""
    record = new_record(
        "train_step",
        model,
        gpu,
        fsdp * tp,
        dict(fsdp=fsdp, tp=tp, remat=cfg.remat, remat_policy=cfg.remat_policy),
        dict(rows=rows, seq_len=seq_len, micro_batches=micro_batches),
        cfg.compute_dtype,
    )

    def lower():
        trainer = trainer_for(
            cfg,
            topology(gpu, fsdp * tp),
            tp=tp,
            micro_batches=micro_batches,
            head_dtype=cfg.compute_dtype,
        )
        return trainer.lower(_train_state(trainer), _train_batch(trainer, rows, seq_len))

    return _compile(lower, gpu, record)


# --- the weight publish -----------------------------------------------------------------------


def compile_publish(
    cfg: ModelConfig,
    gpu: GpuSpec,
    *,
    model: str,
    fsdp: int = 4,
    tp: int = 2,
    sampler_tp: int = 1,
) -> list[dict]:
    """The two compiled halves of a publish (module docstring) and the copy between them."""
    devices = topology(gpu, max(fsdp * tp, sampler_tp))
    trainer_devices, sampler_devices = devices[: fsdp * tp], devices[:sampler_tp]
    layout = dict(fsdp=fsdp, tp=tp, sampler_tp=sampler_tp)
    _, abstract_params = decoder.abstract_init(cfg)
    # What a publish moves: the params narrowed to what decoding reads (sampler.prepare).
    dtypes = fwd.publish_dtypes(cfg, abstract_params, head_dtype=cfg.compute_dtype) or {}
    narrow = lambda p: fwd.narrow_for_decode(p, dtypes)  # noqa: E731
    sent = jax.eval_shape(narrow, abstract_params)
    sent_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(sent))
    sent_dtype = "+".join(sorted({jnp.dtype(x.dtype).name for x in jax.tree.leaves(sent)}))
    gather = new_record("publish_gather", model, gpu, fsdp * tp, layout, {}, sent_dtype)
    prepare = new_record("publish_prepare", model, gpu, sampler_tp, layout, {}, cfg.compute_dtype)

    def lower_gather():
        mesh = trainer_mesh(trainer_devices, tp=tp)
        trainer_sh = sharding.param_shardings(abstract_params, mesh)
        # What each sampler device is sent, laid out on the trainer's devices: its tp share
        # where the trainer's tp groups match the sampler's, else a whole copy.
        keep_tp = sampler_tp > 1 and tp == sampler_tp
        out_sh = input_shardings(abstract_params, mesh, "tp" if keep_tp else None)
        return jax.jit(narrow, out_shardings=out_sh).lower(_abstract(abstract_params, trainer_sh))

    def lower_prepare():
        engine = sampler_engine(cfg, sampler_devices, batch=8, context_len=64, page_size=16)
        in_sh = input_shardings(abstract_params, engine.mesh, engine.tp_axis)
        return engine.prepare_params.lower(_abstract(sent, in_sh))

    records = [_compile(lower_gather, gpu, gather), _compile(lower_prepare, gpu, prepare)]
    copy = new_record("publish_copy", model, gpu, sampler_tp, layout, {}, sent_dtype)
    copy.update(
        ok=True,
        error=None,
        compiled=False,
        # Each sampler device receives its tp share of the narrowed params.
        bytes_per_device=int(sent_bytes // sampler_tp),
    )
    records.insert(1, copy)
    return records
