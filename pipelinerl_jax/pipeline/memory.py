"""Start-up memory estimate of a run, with a breakdown, and a one-line refusal when it cannot fit.

A run that does not fit in memory otherwise dies minutes in (after loading and compiling) from
the kernel's OOM killer, with no message at all. `estimate` adds up, from the config alone, what
the trainer and the sampler hold at the run's peak; `check_fits` compares that with what the
machine has (`host_memory.available_bytes`) and raises a `ConfigError` naming the largest items and the
knobs that shrink them.

    est = memory.estimate(cfg, model_cfg)          # cfg: RunConfig, model_cfg: ModelConfig
    logging.info("%s", est)                        # memory estimate: 3.7 GiB (params 0.50, ...)
    memory.check_fits(est, host_memory.available_bytes())

The items (bytes; letters: L layers, E hidden, F mlp, H q heads, K kv heads, D head dim,
V vocabulary, R rows per step, A micro-batches, T row length, N = R/A * T tokens per
micro-batch, B sampler slots; see pipelinerl_jax/__init__.py):

- params: the trainer's params, exact count x param itemsize.
- LoRA (model.lora): params add the adapters, and are the adapters alone when the trainer
  reads the sampler's base on a shared device (models/shared_base.py); optimizer and
  gradients count the adapters only and no reference copy (the KL reference is the frozen
  base); the sampler holds one decode view of the base and the adapters of the version it
  decodes, and a publish copies the adapters only.
- optimizer: AdamW mu and nu, always f32 (2 x count x 4), plus the frozen reference params
  (param dtype) when the loss has a KL term.
- gradients: the f32 gradient (count x 4); with A > 1 micro-batches the scan's accumulator
  and the current micro-batch's gradient, which holds only the parameters outside the layers
  (embedding, final norm, head) when the backward adds the layers' into the accumulator in
  place (trainer.accumulate_in_place, no LoRA: models/accumulating_scan.py), and
  all of them otherwise.
- sampler_params: `sampler.forward.decode_params`, the sampler's own copy of the version it
  decodes (embedding and layers in compute dtype, plus the LM head [V, E] in the sampler's
  head dtype). In deterministic pipeline mode also up to max_lag published versions waiting
  to be taken in order (pipeline/weights.py keep_all).
- publish: what a publish holds while it runs: the next version's decode copy, prepared while
  the current one still decodes, and the publisher's copy of the trainer's params that the
  conversion reads (pipeline/weights.py: it never aliases the trainer's buffers, which the
  next step donates), already cast to what decode reads (forward.publish_dtypes). Decode's
  dtype is `sampler.compute_dtype` when set, else the model's compute dtype.
- kv_pool: the page pool exactly as `pages.size_pool` sizes it for the sampler config.
- decode_stage: the staged attention's dense copy of every slot's window (staged.py), at the
  longest window, 2 * L * B * max_seq_len * K * D * itemsize.
- eval_sampler: with held-out evaluation on (eval_every or eval.at_start), the evaluation's own
  sampler while it runs: one decode copy of the params (with LoRA of the adapters only: it
  reads the main sampler's base), its KV pool and decode stage (it is built for each
  evaluation and dropped after, pipeline/components.py build_evaluator).
- activations: the train step's. With remat: the residual stream [R/A, T, E] and the attention
  output and log-sum-exp saved per layer (remat_policy "matmuls": also q, k, v, the residual
  after attention, gate and up), plus one layer's recomputed internals. Without:
  every layer's internals, plus one more for the cotangents of the layer being
  differentiated. Either way plus the LM head's working set
  (rl/logprobs.py): two f32 logit chunks ([min(token_chunk, N), V] on the fused per-token path,
  [N, vocab_chunk] for gspo) and the f32 head gradient [E, V].
- runtime: a fixed overhead for the interpreter, JAX/XLA and the compiled executables: the
  trainer's (RUNTIME_BYTES) and the sampler's (SAMPLER_RUNTIME_BYTES).


Phases. params, optimizer, sampler_params, kv_pool, decode_stage and runtime are held for the
whole run. The rest are transients of three phases that take turns: a train step (gradients
and activations), a publish (after a step: the copy and the conversion are
dispatched at once and take a fraction of a second) and an evaluation (between steps, in the
trainer's thread). So on a shared memory the peak is what is held plus the largest phase, not
the sum of all three; on separate memories each side counts its own phases. An RSS trace of
configs/smollm2_math.py (0.2 s samples, bench/rss_trace.py) shows the turns: ~2.8 GiB just after the per-step
release, ~4.8 through a train step with a ~1 s rise to 5.0 at its start (the swap), 3.4-4.0
during publishes and decoding, 3.9-4.1 during an evaluation.

Calibration (SmolLM2-135M, f32, 16 rows x 288 tokens, attention_block 128; peak RSS measured
with /usr/bin/time -v, see tests/test_memory.py): train step alone 14.45 GB without remat, 3.89
GB with remat, 4.15 GB with remat and 4 micro-batches (the trainer's items and RUNTIME_BYTES
alone: 13.8, 4.0 and 3.8 GiB); a whole pipeline run (plus a 16-slot x 288-token f32 sampler,
no remat) 15.85 GB (estimate 15.1 GiB): within 12% of either reading of "GB" (10^9 or 2^30
bytes). configs/smollm2_math.py (remat keeping the matmuls, shared prompts, 16 one-row
micro-batches, evaluation on, a checkpoint every 10 steps) peaked at 4.61 GiB over a 48-step
launched run, estimate 4.6 GiB (2026-11-29; 4.31 in a run checkpointing only at its end, whose
steps before the first checkpoint already peaked 0.15 GiB lower: steps vary that much from
run to run; 4.98 and 5.0 before the layers' gradients were added in place); with LoRA
rank 16 at 2.74 GiB, estimate 2.6 (bench/real_learning.py, 2026-11-28). The sum of every
item's peak, the model before the phases, says 6.5 and 2.7. XLA's own buffer assignment of
that train step (compiled.memory_analysis(), CPU) has 1.04 GiB of temporaries where
gradients + activations count 1.21 (1.44 and 1.60 in the summed form).

The runtime items are calibrated on SmolLM2 runs and lean high for toy models: the default
config (a 2-layer, 0.4M-parameter model) peaked at 0.54 GiB over its 1000 steps against 1.1
estimated (bench/rss_trace.py around `python launch.py`, 2026-11-28).

A checkpoint save is not a phase of its own: on CPU it is written between steps with at most
two of the largest leaves in flight (train/checkpoint.py; ~0.2 GiB above what is held for
SmolLM2-135M, less than any phase above), and on an accelerator its host copy is outside the
device's memory.

Not modelled: sharding (everything is counted as if one device held it; on a sharded mesh
params, moments and gradients divide over the fsdp x tp devices), the reference model's forward
activations, and the sampler's prefill activations (small next to the items above).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import param_counts
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.sampler import forward as fwd
from pipelinerl_jax.sampler import pages as pg
from pipelinerl_jax.sampler import strategies

GiB = 2**30
F32 = 4  # bytes: optimizer moments, gradient accumulators, attention scores, logits
# Interpreter + JAX/XLA libraries + compiled executables + host-side buffers (batches,
# tokenizer, staging copies): what a train-step-only process of SmolLM2-135M held beyond the
# items above (its four peak-RSS measurements, see the module docstring, fit with ~0.6 GiB).
RUNTIME_BYTES = int(0.6 * GiB)
# What a run's process holds beyond that with the sampler in it: the decode and prefill
# programs compiled for every width and window bucket, the evaluation's, the tokenizer and
# the data. Measured as RSS minus jax.live_arrays() after pipeline.components.build of
# configs/smollm2_math.py: 0.92 GiB full, 1.13 GiB with LoRA (module docstring).
SAMPLER_RUNTIME_BYTES = int(0.4 * GiB)
# Compute-dtype values one layer keeps per token for its backward pass, in units of E, H*D,
# K*D and F: the residual input, two RMSNorm outputs (normalised and scaled), o_proj and down
# outputs and the mid-layer residual (6 E); q, its RoPE pieces, its head-major copy and the
# attention output before and after the transpose (5 H*D); k and v likewise (5 K*D); gate, up,
# silu(gate), its sigmoid and the gated product (5 F). Fitted with _SCORE_COPIES to the
# no-remat measurement (XLA keeps about these; fusion hides some).
_LAYER_E, _LAYER_HD, _LAYER_KD, _LAYER_F = 6, 5, 5, 5
# f32 [B, H, query block, keys] arrays per attention block kept for the backward: the scaled
# scores, the masked scores and the softmax.
_SCORE_COPIES = 3
# [tokens, vocabulary chunk] f32 arrays live at once in the LM head's chunk loop: the logits
# and their softmax / gradient (elementwise work fuses into these).
_LOGIT_COPIES = 2

# Item name -> label in the summary and the refusal.
_LABELS = {
    "params": "params",
    "optimizer": "optimizer",
    "gradients": "gradients",
    "sampler_params": "sampler params",
    "kv_pool": "KV pool",
    "decode_stage": "decode stage",
    "eval_sampler": "eval sampler",
    "publish": "publish",
    "activations": "activations",
    "runtime": "runtime",
}
# Held for the whole run, by side.
_TRAINER_STATE = ("params", "optimizer")
_SAMPLER_STATE = ("sampler_params", "kv_pool", "decode_stage")
# Held while one phase runs, then freed (module docstring: why they do not add up).
_PHASES = {
    "step": ("gradients", "activations"),
    "publish": ("publish",),
    "eval": ("eval_sampler",),
}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of a run by item, in bytes (the module docstring says what each holds)."""

    params: int
    optimizer: int
    gradients: int
    sampler_params: int
    kv_pool: int
    decode_stage: int
    activations: int
    runtime: int
    eval_sampler: int = 0
    publish: int = 0
    remat: bool = False  # how activations were counted (the refusal names it)
    shared_device: bool = True  # trainer and sampler in one memory (else: the larger one)

    @property
    def trainer_bytes(self) -> int:
        """The trainer's side at its peak: its state plus a step's gradients and activations."""
        return sum(getattr(self, name) for name in (*_TRAINER_STATE, *_PHASES["step"]))

    @property
    def sampler_bytes(self) -> int:
        """The sampler's side at its peak: its state plus the larger of a publish and an eval."""
        state = sum(getattr(self, name) for name in _SAMPLER_STATE)
        return state + max(self.publish, self.eval_sampler)

    def phase_bytes(self, phase: str) -> int:
        """Transient bytes of one phase ("step", "publish" or "eval")."""
        return sum(getattr(self, name) for name in _PHASES[phase])

    @property
    def peak_phase(self) -> str:
        """The phase whose transients set the peak of a shared memory."""
        return max(_PHASES, key=self.phase_bytes)

    @property
    def total(self) -> int:
        """Bytes one memory must hold. Shared: runtime + both sides' state + the largest
        phase's transients (phases take turns: module docstring); else the larger side."""
        if self.shared_device:
            state = sum(getattr(self, name) for name in (*_TRAINER_STATE, *_SAMPLER_STATE))
            return self.runtime + state + self.phase_bytes(self.peak_phase)
        return self.runtime + max(self.trainer_bytes, self.sampler_bytes)

    def items(self) -> list[tuple[str, int]]:
        """(name, bytes) of every item, in field order."""
        return [(name, getattr(self, name)) for name in _LABELS]

    def largest(self, n: int = 2) -> list[tuple[str, int]]:
        """The n largest items that make up the total (runtime excluded: no knob shrinks it).
        On a shared memory only the peak phase's transients count: shrinking another phase
        would not lower the peak."""
        counted = set(_LABELS)
        if self.shared_device:
            off_peak = (names for phase, names in _PHASES.items() if phase != self.peak_phase)
            counted -= {name for names in off_peak for name in names}
        items = [(k, v) for k, v in self.items() if k in counted and k != "runtime" and v > 0]
        return sorted(items, key=lambda kv: -kv[1])[:n]

    def __str__(self) -> str:
        def listed(names) -> str:
            return ", ".join(
                f"{_LABELS[n]} {getattr(self, n) / GiB:.2f}" for n in names if getattr(self, n)
            )

        held = listed((*_TRAINER_STATE, *_SAMPLER_STATE, "runtime"))
        phases = []
        for phase, names in _PHASES.items():
            if not self.phase_bytes(phase):
                continue
            label = phase if len(names) > 1 else _LABELS[names[0]]
            inner = f" ({listed(names)})" if len(names) > 1 else ""
            phases.append(f"{label} {self.phase_bytes(phase) / GiB:.2f}{inner}")
        if self.shared_device:
            where = f"; plus the largest phase: {', '.join(phases)}"
        else:
            where = f"; phases: {', '.join(phases)}; larger of trainer / sampler memory"
        return f"memory estimate: {self.total / GiB:.1f} GiB ({held}{where})"


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def _blocked_score_elements(T: int, block: int) -> int:
    """Query x key pairs the trainer's attention scores cover per row and head.

    Mirrors models.attention.blocked_causal_attention: ceil(T / block) query blocks (at most 16) of
    ceil(T / blocks) rows, block [a, b) scoring keys [0, b); block 0 is the plain T x T mask."""
    if block <= 0:
        return T * T
    num = min(max(1, math.ceil(T / block)), 16)
    size = math.ceil(T / num)
    return sum((min(a + size, T) - a) * min(a + size, T) for a in range(0, T, size))


def layer_internals_bytes(model_cfg: ModelConfig, rows: int, T: int, block: int) -> int:
    """What one layer keeps for its backward over [rows, T] tokens (see the constants above)."""
    m = model_cfg
    c = _itemsize(m.compute_dtype)
    per_token = (
        _LAYER_E * m.hidden_size
        + _LAYER_HD * m.num_heads * m.head_dim
        + _LAYER_KD * m.num_kv_heads * m.head_dim
        + _LAYER_F * m.intermediate_size
    )
    scores = _SCORE_COPIES * rows * m.num_heads * _blocked_score_elements(T, block) * F32
    return rows * T * per_token * c + scores


def head_working_bytes(model_cfg: ModelConfig, tokens: int, loss_cfg) -> int:
    """The LM head's working set in the loss (rl/logprobs.py): f32 logit chunks and f32 dW."""
    V, E = model_cfg.vocab_size, model_cfg.hidden_size
    if loss_cfg.fused:  # token chunks over the whole vocabulary
        chunk = min(loss_cfg.token_chunk, tokens) * V
    else:  # vocabulary chunks over every token
        chunk = tokens * min(loss_cfg.vocab_chunk, V)
    head_f32 = 0 if model_cfg.param_dtype == "float32" else E * V * F32  # the f32 view of W
    return _LOGIT_COPIES * chunk * F32 + E * V * F32 + head_f32


def _sampler_kv_pool(cfg, model_cfg: ModelConfig) -> tuple[pg.PoolSize, int]:
    """(the pool Sampler builds for cfg.sampler on one data shard, cache itemsize)."""
    s = cfg.sampler
    return pg.sampler_pool(s, model_cfg), _itemsize(pg.cache_dtype(s, model_cfg))


def _uses_staged(attention: str) -> bool:
    """Whether decode attention resolves to the "staged" strategy (sampler/strategies.py)."""

    return strategies.resolve(attention) == "staged"


def estimate(cfg, model_cfg: ModelConfig, *, shared_device: bool = True) -> MemoryEstimate:
    """Peak memory of the run `cfg` (a RunConfig) for the model `model_cfg`, by item.

    shared_device: the sampler and the trainer share one memory (one device, or CPU devices
    of one host); False counts the larger of the two sides only (they sit on separate
    accelerators). Remat is read from model_cfg.remat."""
    m = model_cfg
    p_size, c_size = _itemsize(m.param_dtype), _itemsize(m.compute_dtype)
    count = param_counts.num_params(m)
    # With LoRA only the adapters train: moments, gradients, publishes and the sampler's
    # per-version copies are adapter-sized, and the KL reference is the frozen base itself.
    adapters = param_counts.num_adapter_params(m)
    trained = adapters if m.lora else count
    params = count * p_size + adapters * F32  # adapters are f32 (models/lora.py)
    reference = count * p_size if cfg.trainer.loss.uses_reference and not m.lora else 0
    optimizer = 2 * trained * F32 + reference
    micro = cfg.trainer.micro_batches
    gradients = trained * F32
    if micro > 1:
        in_place = cfg.trainer.accumulate_in_place and not m.lora
        outside_layers = count - param_counts.num_layer_params(m)
        gradients += (outside_layers if in_place else trained) * F32

    # decode_params: embedding and layers in the sampler's compute dtype (sampler.compute_dtype,
    # else the model's), final norm as is, the [V, E] head in the sampler's head dtype (an
    # untied lm_head is only ever there as that head).
    s_size = _itemsize(cfg.sampler.compute_dtype or m.compute_dtype)
    V, E = m.vocab_size, m.hidden_size
    untied_head = 0 if m.tie_word_embeddings else E * V
    head_size = _itemsize(cfg.sampler.head_dtype or "float32")
    # A tied head is the table itself only where both are one f32 array
    # (forward.one_tied_table): a 16-bit table is kept as its uint16 bits, so a 16-bit head
    # is a second array.
    own_head = bool(untied_head) or head_size != s_size or s_size == 2
    decode_copy = (count - untied_head - E) * s_size + E * p_size + own_head * V * E * head_size
    if m.lora:  # the base's decode view once (param_view.py), and each version's adapters
        version_copy = adapters * s_size  # what each version adds to the sampler
        sampler_params = decode_copy + version_copy
        publish = version_copy + adapters * F32  # the next version's, and the f32 one sent
        decode_copy += adapters * s_size
        if shared_device and s_size == p_size and head_size in (p_size, F32):
            # The trainer reads that view instead of a base of its own (models/shared_base.py).
            params = adapters * F32
    else:
        # The publisher's copy is made after forward.narrow_for_decode, in the dtypes its
        # rule (forward.narrowed_dtypes) gives each top-level name.
        counts = {"layers": count - V * E - untied_head - E, "embed": V * E, "final_norm": E}
        if untied_head:
            counts["lm_head"] = untied_head
        sampler_model = dataclasses.replace(
            m, compute_dtype=cfg.sampler.compute_dtype or m.compute_dtype
        )
        narrowed = (
            fwd.narrowed_dtypes(
                sampler_model,
                {name: {m.param_dtype} for name in counts},
                cfg.sampler.head_dtype or "float32",
            )
            or {}
        )
        published = sum(
            n * _itemsize(narrowed.get(name, m.param_dtype)) for name, n in counts.items()
        )
        version_copy = decode_copy
        sampler_params = decode_copy
        publish = version_copy + published  # the next version's, and the copy it reads

    if cfg.deterministic:  # pipeline mode only (RunConfig refuses it in conventional mode)
        # Every published version is kept until the sampler takes it, in order
        # (pipeline/weights.py keep_all): up to max_lag of them beside the one decoding,
        # across steps, so they are state, not a publish's transient.
        sampler_params += cfg.max_lag * version_copy

    pool, cache_size = _sampler_kv_pool(cfg, m)
    s = cfg.sampler
    window = pg.max_pages_per_slot(s.max_seq_len, s.page_size) * s.page_size
    stage_per_layer = 2 * s.num_slots * window * m.num_kv_heads * m.head_dim * cache_size
    if _uses_staged(s.attention):
        decode_stage = m.num_layers * stage_per_layer
    elif s.attention == "gather":  # one layer's window gathered at a time
        decode_stage = stage_per_layer
    else:  # the paged kernel reads the pages in place
        decode_stage = 0

    rows, T = cfg.batch.num_rows // micro, cfg.batch.seq_len
    layer = layer_internals_bytes(m, rows, T, cfg.trainer.attention_block)
    if m.remat:
        # Saved: each layer's input [rows, T, E] and its attention output [rows, T, H * D] with
        # the f32 log-sum-exp [rows, H, T] (models/remat.py); the backward recomputes one
        # layer at a time.
        per_token = (E + m.num_heads * m.head_dim) * c_size + m.num_heads * F32
        if m.remat_policy == "matmuls":  # q, k, v, the residual after attention, gate and up
            kv, F = m.num_kv_heads * m.head_dim, m.intermediate_size
            per_token += (m.num_heads * m.head_dim + 2 * kv + E + 2 * F) * c_size
        saved = m.num_layers * rows * T * per_token + layer
    else:
        # Saved: every layer's internals; plus the cotangents of the layer being differentiated.
        saved = (m.num_layers + 1) * layer
    activations = saved + head_working_bytes(m, rows * T, cfg.trainer.loss)

    evaluates = bool(cfg.eval_every or cfg.eval.at_start)
    # With LoRA the evaluation's sampler reads the main sampler's base: its adapters only.
    eval_params = adapters * s_size if m.lora else decode_copy
    eval_sampler = (eval_params + pool.total_bytes + decode_stage) if evaluates else 0
    return MemoryEstimate(
        params=params,
        optimizer=optimizer,
        gradients=gradients,
        sampler_params=sampler_params,
        kv_pool=pool.total_bytes,
        decode_stage=decode_stage,
        activations=activations,
        runtime=RUNTIME_BYTES + SAMPLER_RUNTIME_BYTES,
        eval_sampler=eval_sampler,
        publish=publish,
        remat=m.remat,
        shared_device=shared_device,
    )


# Item -> the knobs that shrink it, as the refusal lists them.
_KNOBS = {
    "activations": ("raise trainer.micro_batches", "lower batch.num_rows or batch.seq_len"),
    "gradients": ("set model.param_dtype='bfloat16' or use a smaller model",),
    "optimizer": ("set model.param_dtype='bfloat16' or use a smaller model",),
    "params": ("set model.param_dtype='bfloat16' or use a smaller model",),
    "sampler_params": ("set sampler.compute_dtype='bfloat16' (or model.compute_dtype)",),
    "publish": ("set sampler.compute_dtype='bfloat16' (or model.compute_dtype)",),
    "kv_pool": ("lower sampler.num_slots or sampler.max_seq_len (or set sampler.num_pages)",),
    "decode_stage": ("set sampler.attention='paged'", "lower sampler.num_slots"),
    "eval_sampler": (
        "set eval_every=0 and eval.at_start=False (evaluate afterwards with "
        "python -m pipelinerl_jax.evaluate --workdir)",
    ),
}


def check_fits(est: MemoryEstimate, available: int | None, *, slack: float = 0.9) -> None:
    """Raises a one-line ConfigError when est.total exceeds `slack` of `available` bytes.

    The message names the estimate, what is available, the two largest items and the knobs
    that shrink them. `available` None (unknown) passes."""
    if available is None or est.total <= slack * available:
        return
    largest = est.largest(2)
    described = []
    for name, value in largest:
        text = f"{_LABELS[name]} {value / GiB:.1f} GiB"
        if name == "activations" and not est.remat:
            text += " without remat"
        described.append(text)
    knobs = []
    if any(name == "activations" for name, _ in largest) and not est.remat:
        knobs.append("set model.remat=True")
    for name, _ in largest:
        knobs.extend(k for k in _KNOBS.get(name, ()) if k not in knobs)
    raise ConfigError(
        f"memory estimate {est.total / GiB:.1f} GiB exceeds {slack:.0%} of the "
        f"{available / GiB:.1f} GiB available ({', '.join(described)}): {'; '.join(knobs)}"
    )
