"""The decoder block, written once, and the two activation layouts it runs in.

`decoder_block` is the pre-norm block of every family (a family.Family supplies its norm and MLP
activation). How its matmuls are laid out is a `Layout`, chosen by the caller:

- `TOKEN_MAJOR`: activations [B, T, E], weights as stored (input-major, `x @ w`). The model's
  own forward (decoder.py) and the sampler on GPUs run it.
- `FEATURE_MAJOR`: activations [E, N] (N = B * T tokens minor), every projection an
  output-major [O, I] matrix (`prepare` transposes once per weight version). The sampler on
  CPU runs it, for the reasons measured in `FeatureMajor`'s docstring.

Both compute the same arithmetic in the same order (f32 accumulation, one rounding per
matmul); the sampler tests compare each against transformers token for token.

Letters (see pipelinerl_jax/__init__.py): B rows, T tokens per row, N = B * T, E hidden,
F MLP, H query heads, K kv heads, D head dim, O output features, I input features.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pipelinerl_jax.models import cpu_matrix_units, lora, rope
from pipelinerl_jax.models.mixed_matmul import mixed_matmul

# attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layer_cache) -> (out_BxTxHxD, new_layer_cache)
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """Llama's RMSNorm over `axis`: statistics in f32, normalised x rounded to x's dtype, then
    scaled by the weight in x's dtype (transformers' order)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
    return _along(weight.astype(x.dtype), x.ndim, axis) * normed.astype(x.dtype)


def rms_norm_plus_one(x: jax.Array, weight: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """Gemma's RMSNorm: scaled by (1 + w) in f32 and rounded once (weights stored as HF's)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
    scale = 1.0 + _along(weight.astype(jnp.float32), x.ndim, axis)
    return (normed * scale).astype(x.dtype)


def _along(weight: jax.Array, ndim: int, axis: int) -> jax.Array:
    """A 1-D weight shaped to broadcast along `axis` of an ndim-D array."""
    shape = [1] * ndim
    shape[axis] = -1
    return weight.reshape(shape)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """transformers' gelu_pytorch_tanh."""
    return jax.nn.gelu(x, approximate=True)


def dense(x_BxTxI: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    """x @ w over the first `n_in` dims of w, as one 2-D matmul on free reshapes.

    Spelling the projections as einsums over split head axes (e.g. "bthd,hde->bte") let XLA
    CPU pick a contraction order that transposed the weight and the activations on every call.
    Rows are flattened to one [B*T, I] matrix as well: with a 3-D left operand XLA CPU wrote
    transposed [O, B*T] copies in every weight-gradient matmul of the backward pass.

    Accumulated in f32 and rounded once to x's dtype: for bf16 that is what lets XLA:CPU take
    its fast matmul path (docs/cpu_measurements.md#f32-accumulation; f32 inputs are
    unaffected).
    """
    ins, outs = w.shape[:n_in], w.shape[n_in:]
    lead = x_BxTxI.shape[: x_BxTxI.ndim - n_in]
    x2 = x_BxTxI.reshape(math.prod(lead), math.prod(ins))
    w2 = w.reshape(math.prod(ins), math.prod(outs))
    if jnp.dtype(x_BxTxI.dtype).itemsize == 2:  # backward on 16-bit operands too (mixed_matmul)
        return mixed_matmul(x2, w2, x_BxTxI.dtype).reshape(*lead, *outs)
    y2 = jnp.matmul(x2, w2, preferred_element_type=jnp.float32)
    return y2.astype(x_BxTxI.dtype).reshape(*lead, *outs)


class TokenMajor:
    """Activations [B, T, E]; weights input-major as stored. Plain JAX, nothing backend-tuned."""

    name = "token_major"
    feature_axis = -1

    def prepare(self, lp: dict, n_in: dict[str, int], dtype) -> dict:
        """One layer's stored params -> what `project` reads: cast, layout unchanged."""
        return {key: w.astype(dtype) for key, w in lp.items()}

    def project(self, x, w, n_in: int):
        """[..., in dims] @ w -> [..., out dims] (q_proj leaves [B, T, H, D] directly)."""
        return dense(x, w, n_in)

    def split_heads(self, y, batch_shape, head_dim: int):
        return y  # `project` already left [B, T, heads, D]

    def merge_heads(self, attn_BxTxHxD):
        return attn_BxTxHxD  # o_proj contracts (H, D) itself (n_in = 2)

    def tokens(self, x):
        """The activations as [B, T, E] (the final hidden state's layout)."""
        return x


class FeatureMajor:
    """Activations [E, N] (N = B * T minor); projections output-major [O, I]. The CPU layout.

    Why not token-major: at decode N is the batch (8-64 rows), and XLA:CPU's matmul (YNNPACK)
    splits work over the rows of the left operand, so an [N, E] @ [E, O] product with N <= 32
    ran on one core. Laid out the other way round, O (512-3072 output features) is the row
    dimension and both cores work (docs/cpu_measurements.md#feature-major-layout).

    q/k/v leave their matmuls as [O, N] and are transposed to the token-major [B, T, heads, D]
    that biases, qk-norm, RoPE and attention use; the attention output is transposed back once
    for o_proj.
    """

    name = "feature_major"
    feature_axis = 0

    def __init__(self, batch_shape=None):
        self.batch_shape = batch_shape

    def prepare(self, lp: dict, n_in: dict[str, int], dtype) -> dict:
        """Matmul weights (input-major, e.g. q_proj [E, H, D]) -> output-major [O, I]; all cast."""
        out = {}
        for key, w in lp.items():
            if n_in.get(key):
                w = w.reshape(math.prod(w.shape[: n_in[key]]), -1).T
            out[key] = w.astype(dtype)
        return out

    def project(self, x_IxN, w_OxI, n_in: int):
        """w @ x, accumulated in f32 and returned in x's dtype (`output_major_matmul`)."""
        return output_major_matmul(w_OxI, x_IxN).astype(x_IxN.dtype)

    def split_heads(self, y_OxN, batch_shape, head_dim: int):
        """[heads * D, N] -> token-major [B, T, heads, D]."""
        # The barrier keeps XLA from folding this transpose into the matmul: folded, the product
        # becomes an [N, O] dot with a transposed operand that YNNPACK does not take, and its
        # fallback is slow. With it, the matmul stays [O, I] @ [I, N] and only the small [O, N]
        # result is transposed (docs/cpu_measurements.md#the-qkv-barrier).
        y_OxN = jax.lax.optimization_barrier(y_OxN)
        return y_OxN.T.reshape(*batch_shape, -1, head_dim)

    def merge_heads(self, attn_BxTxHxD):
        """[B, T, H, D] -> [H * D, N] for o_proj."""
        n = math.prod(attn_BxTxHxD.shape[:2])
        return attn_BxTxHxD.reshape(n, -1).T

    def tokens(self, x_ExN):
        return x_ExN.T.reshape(*self.batch_shape, -1)


def output_major_matmul(w_OxI: jax.Array, x_IxN: jax.Array) -> jax.Array:
    """w @ x with x in w's dtype, accumulated in f32: the f32 [O, N] product (CPU layout).

    For 16-bit weights the f32 accumulation is what lets XLA:CPU take its fast path
    (docs/cpu_measurements.md#f32-accumulation). One 16-bit token (N = 1) is a
    matrix-vector product, which XLA would rewrite into a slow multiply-reduce over weights
    converted to f32; it runs as `one_16bit_token` instead. f32 weights keep the plain
    product, the fast one for them at every N.
    """
    f32 = jnp.float32
    x_IxN = x_IxN.astype(w_OxI.dtype)
    if x_IxN.shape[1] == 1 and w_OxI.dtype != f32:
        return one_16bit_token(w_OxI, x_IxN)
    return jnp.matmul(w_OxI, x_IxN, preferred_element_type=f32)


def one_16bit_token(w_OxI: jax.Array, x_Ix1: jax.Array, *, amx: bool | None = None) -> jax.Array:
    """[O, I] 16-bit weights times one token [I, 1] -> f32 [O, 1], in the form that reads
    the weights fastest on a CPU with (`amx`; default: this host's) or without AMX
    (docs/cpu_measurements.md#one-16-bit-token).

    With AMX: the token as two identical columns, an [O, I] x [I, 2] product XLA:CPU runs
    on the tiles. Without: an f32 multiply-reduce over I, which XLA:CPU fuses with the
    weights' conversion so they are read once as 16 bits. The barrier ties the weights to
    the token: inside the decode loop the weights are loop-invariant, and without it XLA
    hoists their f32 conversion out of the loop, writing an f32 copy of every weight each
    chunk and reading twice the bytes each step.
    """
    f32 = jnp.float32
    if cpu_matrix_units.has_amx() if amx is None else amx:
        x_Ix2 = jnp.concatenate([x_Ix1, x_Ix1], axis=1)
        return jnp.matmul(w_OxI, x_Ix2, preferred_element_type=f32)[:, :1]
    w_OxI, x_Ix1 = jax.lax.optimization_barrier((w_OxI, x_Ix1))
    return jnp.sum(w_OxI.astype(f32) * x_Ix1[:, 0].astype(f32)[None, :], axis=1, keepdims=True)


TOKEN_MAJOR = TokenMajor()
LAYOUTS = ("token_major", "feature_major")


def matmul_inputs(specs) -> dict[str, int]:
    """Per-layer param name -> n_in, for the matmul weights of a param table."""
    return {s.name: s.n_in for s in specs if s.per_layer and s.n_in}


def decoder_block(
    cfg,
    family,
    layout,
    x,
    lp: dict,
    batch_shape,
    cos,
    sin,
    attend: AttentionFn,
    layer_cache,
    reduce=None,
    keep=None,
):
    """One pre-norm decoder block; `lp` holds this layer's params as `layout.prepare` left them.

    x: [B, T, E] (token-major) or [E, N] (feature-major); batch_shape (B, T).
    `reduce` (tensor parallelism inside shard_map, e.g. a psum over the tp axis) sums the
    partial outputs of the row-split o_proj and down_proj before each residual add; with
    column-split q/k/v/gate/up everything else is local to the device's heads and MLP slice.
    `keep(x, name)` names the values a rematerialising policy may save (models/remat.py
    `keep`, given by a rematerialised forward); None leaves them unnamed, as decoding wants
    (on CPU naming a 16-bit value costs two bitcasts).
    """
    reduce = reduce or (lambda y: y)
    keep = keep or (lambda x, name: x)
    eps, d = cfg.rms_norm_eps, cfg.head_dim
    norm = family.norm

    scale = cfg.lora.scale if cfg.lora else 0.0

    def proj(h, name, n_in=1):  # x·W, plus the LoRA term when lp holds an adapter for it
        return lora.adapted(layout, h, lp, name, n_in, scale)

    def heads(name, h):
        return layout.split_heads(proj(h, name), batch_shape, d)

    h = norm(x, lp["attn_norm"], eps, layout.feature_axis)
    # Named for the "matmuls" remat policy to keep (models/remat.py): the matmul outputs, before
    # the bias, qk-norm and RoPE, whose backward passes read them.
    q_BxTxHxD = keep(heads("q_proj", h), "attention_q")
    k_BxTxKxD = keep(heads("k_proj", h), "attention_k")
    v_BxTxKxD = keep(heads("v_proj", h), "attention_v")
    if cfg.attention_bias:
        q_BxTxHxD = q_BxTxHxD + lp["q_bias"]
        k_BxTxKxD = k_BxTxKxD + lp["k_bias"]
        v_BxTxKxD = v_BxTxKxD + lp["v_bias"]
    if cfg.qk_norm:
        q_BxTxHxD = norm(q_BxTxHxD, lp["q_norm"], eps)
        k_BxTxKxD = norm(k_BxTxKxD, lp["k_norm"], eps)
    q_BxTxHxD = rope.apply(q_BxTxHxD, cos, sin)
    k_BxTxKxD = rope.apply(k_BxTxKxD, cos, sin)
    attn_BxTxHxD, layer_cache = attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layer_cache)
    x = x + reduce(proj(layout.merge_heads(attn_BxTxHxD), "o_proj", 2))
    x = keep(x, "residual_mid")
    h = norm(x, lp["mlp_norm"], eps, layout.feature_axis)
    gate = keep(proj(h, "gate_proj"), "mlp_gate")
    up = keep(proj(h, "up_proj"), "mlp_up")
    gated = family.activation(gate) * up
    return x + reduce(proj(gated, "down_proj")), layer_cache


def embed(cfg, family, embed_VxE, tokens, dtype):
    """Token embeddings in the compute dtype (Gemma-style families scale them by sqrt(E)).

    embed_VxE may be a table already in the 16-bit `dtype` held as its uint16 bit patterns (the
    sampler's decode params, forward.decode_params says why): the gathered rows are viewed back.
    """
    x = jnp.take(embed_VxE, tokens, axis=0)
    if x.dtype == jnp.uint16:
        x = jax.lax.bitcast_convert_type(x, dtype)
    if family.scale_embeddings:
        # transformers rounds sqrt(E) to the table's dtype and multiplies in it.
        x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
    return x.astype(dtype)
