"""The sampler's decoder block, feature-major: activations [E, N] (N = B * T tokens, minor).

Why not the model's token-major block (`llama._layer`, activations [N, E], `x @ w`): at decode
N is the batch (8-64 rows), and XLA:CPU's matmul (YNNPACK) splits work over the rows of the
left operand, so an [N, E] @ [E, O] product with N <= 32 ran on one core. Laid out the other
way round, O (512-3072 output features) is the row dimension and both cores work. Measured on
the bench model's 8-layer projection stack (f32, 2-core EPYC): 20.6 vs 32.6 ms at N = 32,
30.5 vs 35.7 ms at N = 64, 9.3 vs 15.9 ms at N = 8, and equal from N = 256 on (prefill).

So the sampler keeps every projection output-major as one 2-D matrix [O, I] (`prepare_layer`)
and the residual stream as [E, N]. q/k/v leave their matmuls as [O, N] and are transposed to
the token-major [B, T, heads, D] that the biases, qk-norm, RoPE and the attention hook use
(the model's own functions, so the math is the model's); the attention output is transposed
back once for o_proj. The block's arithmetic order matches `llama._layer` step for step; the
sampler tests compare it with transformers token for token and logprob for logprob.

Dimension letters: B rows, T tokens per row, N = B * T, E hidden, F MLP, H query heads,
K kv heads, D head dim, O output features, I input features.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pipelinerl_jax.models import llama, rope
from pipelinerl_jax.models.config import ModelConfig

# Model param name -> number of leading input dims (the rest are output dims).
PROJECTIONS = {
    "q_proj": 1,
    "k_proj": 1,
    "v_proj": 1,
    "o_proj": 2,
    "gate_proj": 1,
    "up_proj": 1,
    "down_proj": 1,
}


def prepare_layer(lp: dict, dtype) -> dict:
    """One layer's model params (input-major, e.g. q_proj [E, H, D]) -> the block's params:
    projections as output-major [O, I] matrices, everything else unchanged, all in `dtype`."""
    out = {}
    for name, w in lp.items():
        if name in PROJECTIONS:
            w = w.reshape(math.prod(w.shape[: PROJECTIONS[name]]), -1).T
        out[name] = w.astype(dtype)
    return out


def rms_norm_fm(x_ExN, weight_E, eps: float):
    """`llama.rms_norm` over the feature axis 0 (statistics in f32, same cast order)."""
    x32 = x_ExN.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=0, keepdims=True) + eps)
    return weight_E.astype(x_ExN.dtype)[:, None] * normed.astype(x_ExN.dtype)


def project(w_OxI, x_IxN):
    """w @ x for output-major weights, accumulated in f32 and returned in x's dtype.

    For 16-bit weights the f32 accumulation is what lets XLA:CPU take its fast path: a bf16
    product with a bf16 result ran at ~220 GFLOP/s at N = 64 on the Xeon (AMX) and the same
    product with f32 accumulation at ~930 GFLOP/s (~30 GB/s of weights from N = 2 on). One
    16-bit token (N = 1) runs as two identical columns: XLA rewrites a matrix-vector product
    into an f32 multiply-reduce that converts the weights to f32 (~2 GB/s of weights; ~17 GB/s
    as a row-vector product, ~30 GB/s as two columns). f32 weights keep the plain product,
    the fast one for them at every N.
    """
    f32 = jnp.float32
    if x_IxN.shape[1] == 1 and w_OxI.dtype != f32:
        y_Ox2 = jnp.matmul(
            w_OxI, jnp.concatenate([x_IxN, x_IxN], axis=1), preferred_element_type=f32
        )
        return y_Ox2[:, :1].astype(x_IxN.dtype)
    return jnp.matmul(w_OxI, x_IxN, preferred_element_type=f32).astype(x_IxN.dtype)


def _heads(y_OxN, batch_shape, heads: int):
    """[heads * D, N] -> token-major [B, T, heads, D]."""
    # The barrier keeps XLA from folding this transpose into the matmul: folded, the product
    # becomes an [N, O] dot with a transposed operand that YNNPACK does not take, and the
    # fallback ran the k/v projections at ~5 GFLOP/s (36% of a batch-8 decode step). With it,
    # the matmul stays [O, I] @ [I, N] and only the small [O, N] result is transposed: decode
    # 410 -> 608 tok/s at batch 8, 835 -> 950 at 32, 990 -> 1090 at 64 (bench model, f32).
    y_OxN = jax.lax.optimization_barrier(y_OxN)
    return y_OxN.T.reshape(*batch_shape, heads, -1)


def layer(
    cfg: ModelConfig, x_ExN, lp: dict, batch_shape, cos, sin, attend, layer_cache, reduce=None
):
    """One pre-norm decoder block on [E, N] activations; `lp` from `prepare_layer`.

    batch_shape: (B, T) with B * T = N. attend and reduce as in `llama._layer`.
    """
    reduce = reduce or (lambda x: x)
    eps = cfg.rms_norm_eps
    h_ExN = rms_norm_fm(x_ExN, lp["attn_norm"], eps)
    heads = lp["q_proj"].shape[0] // cfg.head_dim  # per tp shard
    q_BxTxHxD = _heads(project(lp["q_proj"], h_ExN), batch_shape, heads)
    kv_heads = lp["k_proj"].shape[0] // cfg.head_dim  # per tp shard
    k_BxTxKxD = _heads(project(lp["k_proj"], h_ExN), batch_shape, kv_heads)
    v_BxTxKxD = _heads(project(lp["v_proj"], h_ExN), batch_shape, kv_heads)
    if cfg.attention_bias:
        q_BxTxHxD = q_BxTxHxD + lp["q_bias"]
        k_BxTxKxD = k_BxTxKxD + lp["k_bias"]
        v_BxTxKxD = v_BxTxKxD + lp["v_bias"]
    if cfg.qk_norm:
        q_BxTxHxD = llama.rms_norm(q_BxTxHxD, lp["q_norm"], eps)
        k_BxTxKxD = llama.rms_norm(k_BxTxKxD, lp["k_norm"], eps)
    q_BxTxHxD = rope.apply(q_BxTxHxD, cos, sin)
    k_BxTxKxD = rope.apply(k_BxTxKxD, cos, sin)
    attn_BxTxHxD, layer_cache = attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layer_cache)
    attn_OxN = attn_BxTxHxD.reshape(x_ExN.shape[1], -1).T
    x_ExN = x_ExN + reduce(project(lp["o_proj"], attn_OxN))
    h_ExN = rms_norm_fm(x_ExN, lp["mlp_norm"], eps)
    gated_FxN = jax.nn.silu(project(lp["gate_proj"], h_ExN)) * project(lp["up_proj"], h_ExN)
    return x_ExN + reduce(project(lp["down_proj"], gated_FxN)), layer_cache
