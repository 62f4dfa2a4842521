"""Roofline time of a decode step and a train step from a model's shapes, on published peaks.

Letters as in pipelinerl_jax/pipeline/memory.py: L layers, E hidden, F mlp, H q heads, K kv heads, D head
dim, V vocabulary, P_L the layers' matmul weights (`matmul_params_per_token() - E V`), P every
parameter. A step's `Cost` is its FLOPs and HBM bytes on ONE device; `seconds` is the roofline
max(flops / matmul peak, bytes / HBM bandwidth), an upper bound on speed: no kernel launch gaps,
no collectives (tensor-parallel all-reduces, FSDP gathers and reduce-scatters are not timed), no
attention kernel inefficiency.

Memory per device lives in gpu_memory.py, the planner profile built from these times in
gpu_profile.py; bench/compile_h100.py records the costs and `seconds` of what it compiles.
"""

from __future__ import annotations

import dataclasses

from pipelinerl_jax.models import param_counts
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.pipeline import memory
from pipelinerl_jax.plan.gpu_specs import GpuSpec
from pipelinerl_jax.plan.utilisation import PlanError

# HBM bytes per (query, key) pair per head per layer of the trainer's blocked attention, which
# materialises its scores (no fused flash kernel): forward writes f32 scores (4), reads them for
# the softmax (4), writes and reads 16-bit probabilities (2 + 2); the backward recomputes scores
# from the log-sum-exp (4 + 4 + 2), reads P for dV (2), writes and reads f32 dP (4 + 4), reads P
# again (2), writes dS (2) and reads it for dQ and dK (4). Rough: fusion saves some of these.
SCORE_BYTES_PER_PAIR = 44
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs and HBM bytes of one step on one device."""

    flops: float
    bytes: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


def itemsize(dtype: str) -> int:
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise PlanError(f"dtype {dtype!r}: use one of {sorted(_ITEMSIZE)}") from None


def seconds(cost: Cost, gpu: GpuSpec, dtype: str) -> float:
    """Roofline time: the slower of the matmul peak for `dtype` and the HBM bandwidth."""
    return max(cost.flops / gpu.matmul_flops(dtype), cost.bytes / gpu.hbm_bytes_per_s)


def bound(cost: Cost, gpu: GpuSpec, dtype: str) -> str:
    """ "compute" or "memory": which side of the roofline `seconds` sits on."""
    compute = cost.flops / gpu.matmul_flops(dtype)
    return "compute" if compute >= cost.bytes / gpu.hbm_bytes_per_s else "memory"


def layer_params(cfg: ModelConfig) -> int:
    """Every per-layer parameter (norms and biases included): P minus embedding and head."""
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return param_counts.num_params(cfg) - cfg.vocab_size * cfg.hidden_size - head


def head_split(cfg: ModelConfig, tp: int) -> int:
    """Devices the sampler's LM head is split over (by vocabulary, when V divides by tp)."""
    return tp if tp > 1 and cfg.vocab_size % tp == 0 else 1


def sampler_weight_bytes(
    cfg: ModelConfig, *, tp: int = 1, weight_dtype: str = "bfloat16", head_dtype: str = "float32"
) -> int:
    """One decode copy per device (memory.py's sampler_params item, sharded): layers / tp in
    `weight_dtype`, the [V, E] head in `head_dtype` split by vocabulary, the embedding whole."""
    V, E = cfg.vocab_size, cfg.hidden_size
    layers = layer_params(cfg) * itemsize(weight_dtype) // tp
    head = V * E * itemsize(head_dtype) // head_split(cfg, tp)
    return layers + head + V * E * itemsize(weight_dtype)


def decode_step_cost(
    cfg: ModelConfig,
    *,
    batch: int,
    context_len: float,
    cache_dtype: str = "bfloat16",
    weight_dtype: str = "bfloat16",
    tp: int = 1,
    head_dtype: str = "float32",
) -> Cost:
    """One decode step of `batch` sequences (the tp-device replica's batch) at mean context
    `context_len`, per device.

    FLOPs: 2 B P_L / tp for the projections, 4 B ctx H D L / tp for attention (q k^T and p v,
    each 2 ctx H D per token per layer) and 2 B E V / tp for the LM head. Bytes: every weight
    read once per step (sampler_weight_bytes less the embedding, of which B rows are read), the
    KV cache read, B ctx 2 L (K / tp) D cache bytes, the step's own K and V written, and the f32
    logits written. Activations ([B, E] per layer) are small next to these and left out.
    """
    V, E, L, D = cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.head_dim
    split = head_split(cfg, tp)
    p_layers = param_counts.matmul_params_per_token(cfg) - E * V
    flops = 2.0 * batch * (p_layers / tp + E * V / split)
    flops += 4.0 * batch * context_len * cfg.num_heads * D * L / tp
    kv_token = 2 * L * (cfg.num_kv_heads / tp) * D * itemsize(cache_dtype)  # K and V, all layers
    weights = sampler_weight_bytes(cfg, tp=tp, weight_dtype=weight_dtype, head_dtype=head_dtype)
    weights -= (V - batch) * E * itemsize(weight_dtype)  # only B embedding rows are read
    nbytes = weights + batch * (context_len + 1) * kv_token + batch * V * 4 / split
    return Cost(flops, nbytes)


def attention_pairs(seq_len: int, attention_block: int = 128) -> int:
    """(query, key) pairs the trainer's blocked causal attention computes per row and head:
    the causal half plus the diagonal blocks' upper triangles (memory.py's exact count)."""
    return memory._blocked_score_elements(seq_len, attention_block)


def train_step_cost(
    cfg: ModelConfig,
    *,
    tokens: int,
    seq_len: int,
    remat: bool = True,
    devices: int = 1,
    micro_batches: int = 1,
    attention_block: int = 128,
) -> Cost:
    """One optimizer step over `tokens` tokens (all devices together, packed rows of `seq_len`)
    on `devices` FSDP devices, per device (each computes tokens / devices).

    FLOPs per token: 6 P_L for the layers' matmuls (forward 2, backward 4: dX and dW), plus 2 P_L
    when remat runs the projections again (cfg.remat_policy "attention"; "matmuls" saves their
    outputs and recomputes none); 6 E V for the LM head (the fused loss keeps no recompute);
    attention 7 x 2 pairs H D L per row: forward q k^T and p v, backward the scores again from
    the saved log-sum-exp (blocked attention's VJP), dV, dP, dQ and dK.
    Bytes per device: the optimizer reads and writes f32 master params and both Adam moments
    and reads the f32 gradient, 28 P / devices; FSDP gathers every weight to every device for
    each pass (forward, remat's recompute, backward) in the param dtype and writes its f32
    gradient, per micro-batch; activations: each matmul's input and output per pass, about
    (6 E + 2 H D + 2 K D + 3 F) compute-dtype values a token a layer, 3 passes (4 with the
    projection recompute); the attention scores, SCORE_BYTES_PER_PAIR a pair a head a layer; the
    f32 logits [tokens, V] written and read forward and backward (16 V bytes a token).
    """
    V, E, F, L = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    recompute = remat and cfg.remat_policy == "attention"
    rows = tokens / seq_len
    p_layers = param_counts.matmul_params_per_token(cfg) - E * V
    pairs = attention_pairs(seq_len, attention_block)
    flops = (8.0 if recompute else 6.0) * p_layers * tokens + 6.0 * E * V * tokens
    flops += 7 * 2.0 * pairs * H * D * L * rows

    P, c = param_counts.num_params(cfg), itemsize(cfg.compute_dtype)
    passes = 4 if recompute else 3
    optimizer = 28.0 * P / devices
    gathered = micro_batches * P * ((passes - 1) * itemsize(cfg.param_dtype) + 4)
    per_token = passes * c * L * (6 * E + 2 * H * D + 2 * K * D + 3 * F) + 16 * V
    scores = SCORE_BYTES_PER_PAIR * pairs * H * L * rows
    nbytes = optimizer + gathered + (per_token * tokens + scores) / devices
    return Cost(flops / devices, nbytes)
