"""Llama-family decoder (Llama 2/3.x, Qwen2/2.5, Qwen3 dense, Mistral) in Flax NNX.

The module only holds parameters; the forward is a pure function over the params pytree
(`nnx.split` once, pass `params` through jit). Per-layer params are stacked along a leading
L axis and the layers run under `lax.scan`, so compile time does not grow with depth.
Attention is a hook (`attend`) so that one forward serves packed training rows
(`segment_causal_attention`) and the sampler's cached decoding (its own `attend` reading and
writing a KV cache that is scanned together with the layer params).

Weights are stored input-major (`x @ w` needs no transpose): q_proj [E, H, D], o_proj [H, D, E].

Letters: B batch, T time (queries), S time (keys), L layers, V vocab, E hidden, F mlp,
H query heads, K kv heads, G = H/K query heads per kv head, D head_dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pipelinerl_jax.models import rope
from pipelinerl_jax.models.config import ModelConfig

# attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layer_cache) -> (out_BxTxHxD, new_layer_cache)
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]

_INIT_STD = 0.02  # Hugging Face's default initializer_range.


def _param(value: jax.Array, names: tuple[str | None, ...]) -> nnx.Param:
    # Eager sharding off: logical names are metadata for pipelinerl_jax.sharding, not a mesh spec.
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class Llama(nnx.Module):
    """Parameter container; see `forward_hidden` for the computation."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.param_dtype)
        e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        h, k, n = cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
        # One normal draw sliced into every weight: each separate jax.random call costs about a
        # second of XLA compile time on CPU, which dominated test time with ~15 calls.
        shapes = [
            (cfg.vocab_size, e),
            (n, e, h, d),
            (n, e, k, d),
            (n, e, k, d),
            (n, h, d, e),
            (n, e, f),
            (n, e, f),
            (n, f, e),
        ]
        if cfg.attention_bias:
            shapes += [(n, h, d), (n, k, d), (n, k, d)]
        if not cfg.tie_word_embeddings:
            shapes.append((e, cfg.vocab_size))
        sizes = [math.prod(shape) for shape in shapes]
        flat = _INIT_STD * jax.random.normal(rngs.params(), (sum(sizes),), jnp.float32)
        offsets = iter(range(len(shapes)))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]

        def normal(*shape):
            i = next(offsets)
            assert shapes[i] == shape, (shapes[i], shape)
            return flat[starts[i] : starts[i] + sizes[i]].reshape(shape).astype(dtype)

        def ones(*shape):
            return jnp.ones(shape, dtype)

        self.embed = _param(normal(cfg.vocab_size, e), ("vocab", "embed"))
        layers = dict(
            attn_norm=_param(ones(n, e), ("layers", "norm")),
            q_proj=_param(normal(n, e, h, d), ("layers", "embed", "q_heads", "head_dim")),
            k_proj=_param(normal(n, e, k, d), ("layers", "embed", "kv_heads", "head_dim")),
            v_proj=_param(normal(n, e, k, d), ("layers", "embed", "kv_heads", "head_dim")),
            o_proj=_param(normal(n, h, d, e), ("layers", "q_heads", "head_dim", "embed")),
            mlp_norm=_param(ones(n, e), ("layers", "norm")),
            gate_proj=_param(normal(n, e, f), ("layers", "embed", "mlp")),
            up_proj=_param(normal(n, e, f), ("layers", "embed", "mlp")),
            down_proj=_param(normal(n, f, e), ("layers", "mlp", "embed")),
        )
        if cfg.attention_bias:
            layers["q_bias"] = _param(normal(n, h, d), ("layers", "q_heads", "head_dim"))
            layers["k_bias"] = _param(normal(n, k, d), ("layers", "kv_heads", "head_dim"))
            layers["v_bias"] = _param(normal(n, k, d), ("layers", "kv_heads", "head_dim"))
        if cfg.qk_norm:
            layers["q_norm"] = _param(ones(n, d), ("layers", "head_dim"))
            layers["k_norm"] = _param(ones(n, d), ("layers", "head_dim"))
        self.layers = nnx.Dict(layers)
        self.final_norm = _param(ones(e), ("norm",))
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(normal(e, cfg.vocab_size), ("embed", "vocab"))


def init_params(cfg: ModelConfig, rng: jax.Array) -> nnx.State:
    """Random params (normal(0, 0.02) weights, unit norms); jittable, e.g. with out_shardings."""
    return nnx.split(Llama(cfg, rngs=nnx.Rngs(params=rng)))[1]


_init_params_jit = jax.jit(init_params, static_argnums=0)


def init(cfg: ModelConfig, rng: jax.Array) -> tuple[nnx.GraphDef, nnx.State]:
    """Random init -> (graphdef, params), computed under jit (one compile per config)."""
    graphdef, _ = abstract_init(cfg)
    return graphdef, _init_params_jit(cfg, rng)


def abstract_init(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params of jax.ShapeDtypeStruct) without allocating: for shardings and loading."""
    return nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(params=0))))


def config_of(graphdef: nnx.GraphDef) -> ModelConfig:
    """The ModelConfig stored (as a static attribute) in the graphdef."""
    for name, attr in getattr(graphdef, "attributes", ()):
        if name == "cfg" and isinstance(getattr(attr, "value", None), ModelConfig):
            return attr.value
    raise TypeError("graphdef does not come from pipelinerl_jax.models.llama.init/load_hf")


def arrays(params) -> dict:
    """Nested dict of raw arrays from an nnx.State (or a dict already holding arrays)."""
    if isinstance(params, nnx.State):
        return nnx.to_pure_dict(params)
    return jax.tree.map(
        lambda v: v.get_value() if isinstance(v, nnx.Variable) else v,
        params,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, statistics in f32, as transformers computes it."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def segment_visible(
    segment_ids_BxT: jax.Array, prefix_ids_BxT: jax.Array | None, queries: slice, keys: slice
) -> jax.Array:
    """[B, Q, S] bool: key s is in the query's segment or in the shared prefix it continues
    (`prefix_ids`, -1 for none; see rl/batch.py), and not after the query (causal)."""
    seg_BxT = segment_ids_BxT
    q_BxQ, k_BxS = seg_BxT[:, queries], seg_BxT[:, keys]
    visible_BxQxS = q_BxQ[:, :, None] == k_BxS[:, None, :]
    if prefix_ids_BxT is not None:
        visible_BxQxS |= prefix_ids_BxT[:, queries, None] == k_BxS[:, None, :]
    T = seg_BxT.shape[1]
    q_pos, k_pos = jnp.arange(T)[queries], jnp.arange(T)[keys]
    return visible_BxQxS & (q_pos[:, None] >= k_pos[None, :])


def segment_causal_attention(
    segment_ids_BxT: jax.Array, prefix_ids_BxT: jax.Array | None = None
) -> AttentionFn:
    """Causal attention within each segment of a packed row, none across segments, except that
    a segment also sees the shared-prompt segment its `prefix_ids` name.

    Segments are contiguous runs of equal ids (padding can be its own segment: every query
    attends at least to itself, so no row is fully masked). The layer cache passes through.
    """
    everything = slice(None)
    mask_BxTxS = segment_visible(segment_ids_BxT, prefix_ids_BxT, everything, everything)

    def attend(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, layer_cache):
        return masked_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS), layer_cache

    return attend


def masked_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS) -> jax.Array:
    """Softmax attention with a boolean mask; GQA by grouping queries (K/V never repeated)."""
    B, T, H, D = q_BxTxHxD.shape
    K = k_BxSxKxD.shape[2]
    q_BxTxKxGxD = q_BxTxHxD.reshape(B, T, K, H // K, D)
    scores = jnp.einsum(
        "btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD, preferred_element_type=jnp.float32
    ) * (1.0 / math.sqrt(D))
    scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs_BxKxGxTxS = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxD.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs_BxKxGxTxS, v_BxSxKxD)
    return out.reshape(B, T, H, D)


def _dense(x_BxTxI, w: jax.Array, n_in: int) -> jax.Array:
    """x @ w over the first `n_in` dims of w, as one 2-D matmul on free reshapes.

    Spelling the projections as einsums over split head axes (e.g. "bthd,hde->bte") let XLA
    CPU pick a contraction order that transposed the weight and the activations on every call.
    Rows are flattened to one [B*T, I] matrix as well: with a 3-D left operand XLA CPU wrote
    transposed [O, B*T] copies in every weight-gradient matmul of the backward pass.

    Accumulated in f32 and rounded once to x's dtype: for bf16 that is what lets XLA:CPU take
    its fast matmul path (on a Xeon with AMX, [4096, 512] @ [512, 1536] ran at ~290 GFLOP/s
    with a bf16 result and ~840 with f32 accumulation; f32 inputs are unaffected).
    """
    ins, outs = w.shape[:n_in], w.shape[n_in:]
    lead = x_BxTxI.shape[: x_BxTxI.ndim - n_in]
    x2 = x_BxTxI.reshape(math.prod(lead), math.prod(ins))
    y2 = jnp.matmul(
        x2, w.reshape(math.prod(ins), math.prod(outs)), preferred_element_type=jnp.float32
    )
    return y2.astype(x_BxTxI.dtype).reshape(*lead, *outs)


def _layer(
    cfg: ModelConfig, x_BxTxE, lp: dict, cos, sin, attend: AttentionFn, layer_cache, reduce=None
):
    """One pre-norm decoder block; `lp` holds this layer's params already in compute dtype.

    `reduce` (tensor parallelism inside shard_map, e.g. a psum over the tp axis) sums the
    partial outputs of the row-split o_proj and down_proj before each residual add; with
    column-split q/k/v/gate/up everything else is local to the device's heads and MLP slice.
    """
    reduce = reduce or (lambda x: x)
    eps = cfg.rms_norm_eps
    h = rms_norm(x_BxTxE, lp["attn_norm"], eps)
    q_BxTxHxD = _dense(h, lp["q_proj"], 1)
    k_BxTxKxD = _dense(h, lp["k_proj"], 1)
    v_BxTxKxD = _dense(h, lp["v_proj"], 1)
    if cfg.attention_bias:
        q_BxTxHxD = q_BxTxHxD + lp["q_bias"]
        k_BxTxKxD = k_BxTxKxD + lp["k_bias"]
        v_BxTxKxD = v_BxTxKxD + lp["v_bias"]
    if cfg.qk_norm:
        q_BxTxHxD = rms_norm(q_BxTxHxD, lp["q_norm"], eps)
        k_BxTxKxD = rms_norm(k_BxTxKxD, lp["k_norm"], eps)
    q_BxTxHxD = rope.apply(q_BxTxHxD, cos, sin)
    k_BxTxKxD = rope.apply(k_BxTxKxD, cos, sin)
    attn_BxTxHxD, layer_cache = attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layer_cache)
    x_BxTxE = x_BxTxE + reduce(_dense(attn_BxTxHxD, lp["o_proj"], 2))
    h = rms_norm(x_BxTxE, lp["mlp_norm"], eps)
    gated_BxTxF = jax.nn.silu(_dense(h, lp["gate_proj"], 1)) * _dense(h, lp["up_proj"], 1)
    return x_BxTxE + reduce(_dense(gated_BxTxF, lp["down_proj"], 1)), layer_cache


def forward_hidden(
    graphdef: nnx.GraphDef,
    params,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array,
    *,
    attend: AttentionFn,
    cache=None,
) -> tuple[jax.Array, Any]:
    """Hidden states after the final norm [B, T, E] (compute dtype), and the updated cache.

    `cache` is None or a pytree whose leaves all have a leading L axis; each layer's slice is
    handed to `attend` and the returned slices are stacked into the new cache.
    """
    cfg = config_of(graphdef)
    p = arrays(params)
    dtype = jnp.dtype(cfg.compute_dtype)
    x_BxTxE = jnp.take(p["embed"], tokens_BxT, axis=0).astype(dtype)
    inv_freq = rope.inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope.cos_sin(positions_BxT, inv_freq, dtype)

    def body(x, layer_and_cache):
        lp, layer_cache = layer_and_cache
        lp = jax.tree.map(lambda w: w.astype(dtype), lp)
        return _layer(cfg, x, lp, cos, sin, attend, layer_cache)

    if cfg.remat:
        body = jax.checkpoint(body, prevent_cse=False)
    x_BxTxE, new_cache = jax.lax.scan(body, x_BxTxE, (p["layers"], cache))
    return rms_norm(x_BxTxE, p["final_norm"], cfg.rms_norm_eps), new_cache


def lm_head_weight(params) -> jax.Array:
    """The output projection [E, V]: the untied head, or the embedding transposed."""
    p = arrays(params)
    return p["lm_head"] if "lm_head" in p else p["embed"].T


def logits_from_hidden(params, hidden_BxTxE: jax.Array) -> jax.Array:
    """Logits [B, T, V] in float32 (the head always runs in f32, as in the trainer's logprobs)."""
    w_ExV = lm_head_weight(params).astype(jnp.float32)
    return jnp.einsum(
        "bte,ev->btv", hidden_BxTxE.astype(jnp.float32), w_ExV, preferred_element_type=jnp.float32
    )


def forward(
    graphdef: nnx.GraphDef,
    params,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array,
    segment_ids_BxT: jax.Array | None = None,
    prefix_ids_BxT: jax.Array | None = None,
) -> jax.Array:
    """Full-sequence logits [B, T, V] f32; packed rows when `segment_ids_BxT` is given (with
    shared prompts when `prefix_ids_BxT` is too)."""
    if segment_ids_BxT is None:
        segment_ids_BxT = jnp.zeros(tokens_BxT.shape, jnp.int32)
    attend = segment_causal_attention(segment_ids_BxT, prefix_ids_BxT)
    hidden_BxTxE, _ = forward_hidden(graphdef, params, tokens_BxT, positions_BxT, attend=attend)
    return logits_from_hidden(params, hidden_BxTxE)


@functools.partial(jax.jit, static_argnums=0)
def jit_forward(
    graphdef, params, tokens_BxT, positions_BxT, segment_ids_BxT=None, prefix_ids_BxT=None
):
    """`forward` under jit (graphdef static)."""
    return forward(graphdef, params, tokens_BxT, positions_BxT, segment_ids_BxT, prefix_ids_BxT)
