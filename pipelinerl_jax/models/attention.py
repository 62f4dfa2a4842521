"""Attention over packed rows: the full-sequence attention of training and the model forward.

A packed row holds several sequences (segments) back to back; each token attends causally
within its own segment, and, with shared prompts (rl/batch.py), also to the prompt segment
its `prefix_ids` name. `segment_causal_attention` computes the full [T, S] mask;
`blocked_causal_attention` gives the same result per query block, skipping keys after the
block (what the trainer runs). Both are `block.AttentionFn` hooks for `decoder.forward_hidden`;
the sampler's cached decode attention lives in sampler/strategies.py.

Letters (see pipelinerl_jax/__init__.py): B rows, T tokens (queries), Q a block of queries,
S keys, H query heads, K kv heads, G = H / K, D head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pipelinerl_jax.models import remat
from pipelinerl_jax.models.block import AttentionFn


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


def blocked_causal_attention(segment_ids_BxT, block: int, prefix_ids_BxT=None) -> AttentionFn:
    """Segment-causal attention computed per query block, skipping the blocks above the diagonal.

    Same result as `segment_causal_attention`; for query block [a, b) only keys [0, b) can
    be visible, so scores are [b - a, b] instead of [b - a, T]. q, k, v are moved to head-major
    layout once so every block's matmuls read contiguous [T, D] panels (per-block einsums over
    the token-major layout made XLA CPU transpose K and V again for every block). Blocks are
    unrolled (static shapes), capped at 16 so compile time stays flat for long rows.

    The gradient is written out (`_blocked`, a custom VJP) rather than left to autodiff: the
    backward recomputes each block's probabilities from the saved log-sum-exp and adds each
    block's dK and dV into one buffer, where autodiff padded every block's contribution to the
    whole row and summed the copies; its matmuls take the operands' own dtype (bf16 in bf16
    compute) with f32 accumulation.
    """
    seg_BxT = segment_ids_BxT
    T = seg_BxT.shape[1]
    num = min(max(1, math.ceil(T / max(block, 1))), 16)
    size = math.ceil(T / num)
    bounds = tuple((a, min(a + size, T)) for a in range(0, T, size))
    has_prefix = prefix_ids_BxT is not None
    prefix_BxT = prefix_ids_BxT if has_prefix else seg_BxT  # a placeholder when unused

    def attend(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, layer_cache):
        B, _, H, D = q_BxTxHxD.shape
        K = k_BxSxKxD.shape[2]
        q_BxKxGxTxD = q_BxTxHxD.reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
        k_BxKxSxD = k_BxSxKxD.transpose(0, 2, 1, 3)
        v_BxKxSxD = v_BxSxKxD.transpose(0, 2, 1, 3)
        static = (bounds, 1.0 / math.sqrt(D), has_prefix)
        out_BxKxGxTxD = _blocked(q_BxKxGxTxD, k_BxKxSxD, v_BxKxSxD, seg_BxT, prefix_BxT, *static)
        return out_BxKxGxTxD.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D), layer_cache

    return attend


def _block_scores(q_BxKxGxTxD, k_BxKxSxD, seg_BxT, prefix_BxT, a, b, scale, has_prefix):
    """Scaled scores of query block [a, b) against keys [0, b), f32, the invisible ones at the
    f32 minimum (exp of them minus any finite log-sum-exp is exactly 0)."""
    s_BxKxGxQxS = (
        jnp.einsum(
            "bkgtd,bksd->bkgts",
            q_BxKxGxTxD[:, :, :, a:b],
            k_BxKxSxD[:, :, :b],
            preferred_element_type=jnp.float32,
        )
        * scale
    )
    prefix = prefix_BxT if has_prefix else None
    mask_BxQxS = segment_visible(seg_BxT, prefix, slice(a, b), slice(0, b))[:, None, None]
    return jnp.where(mask_BxQxS, s_BxKxGxQxS, jnp.finfo(jnp.float32).min)


def _blocked_forward(q, k, v, seg, prefix, bounds, scale, has_prefix):
    """(out [B, K, G, T, D] in q's dtype, log-sum-exp [B, K, G, T] f32) from q [B, K, G, T, D]
    and k, v [B, K, S, D], one query block [a, b) of `bounds` at a time."""
    outs, lses = [], []
    for a, b in bounds:
        s_BxKxGxQxS = _block_scores(q, k, seg, prefix, a, b, scale, has_prefix)
        m_BxKxGxQ = s_BxKxGxQxS.max(axis=-1)
        e_BxKxGxQxS = jnp.exp(s_BxKxGxQxS - m_BxKxGxQ[..., None])
        l_BxKxGxQ = e_BxKxGxQxS.sum(axis=-1)
        p_BxKxGxQxS = (e_BxKxGxQxS / l_BxKxGxQ[..., None]).astype(v.dtype)
        outs.append(
            jnp.einsum(
                "bkgts,bksd->bkgtd", p_BxKxGxQxS, v[:, :, :b], preferred_element_type=jnp.float32
            )
        )
        lses.append(m_BxKxGxQ + jnp.log(l_BxKxGxQ))
    out_BxKxGxTxD = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
    lse_BxKxGxT = jnp.concatenate(lses, axis=3) if len(lses) > 1 else lses[0]
    return out_BxKxGxTxD.astype(q.dtype), lse_BxKxGxT


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _blocked(q, k, v, seg, prefix, bounds, scale, has_prefix):
    return _blocked_forward(q, k, v, seg, prefix, bounds, scale, has_prefix)[0]


def _blocked_fwd(q, k, v, seg, prefix, bounds, scale, has_prefix):
    out, lse = _blocked_forward(q, k, v, seg, prefix, bounds, scale, has_prefix)
    # Named so that a rematerialised layer keeps them instead of running the attention forward
    # again in the backward pass (models/remat.py ATTENTION_SAVED).
    out = remat.keep(out, "attention_out", in_vjp_rule=True)
    lse = remat.keep(lse, "attention_lse", in_vjp_rule=True)
    return out, (q, k, v, seg, prefix, out, lse)


def _blocked_bwd(bounds, scale, has_prefix, res, dout_BxKxGxTxD):
    """(dq, dk, dv): each block's probabilities recomputed from the saved log-sum-exp; dk and
    dv accumulate in f32 over the blocks whose keys they are."""
    q, k, v, seg, prefix, out, lse_BxKxGxT = res
    f32 = jnp.float32
    # softmax backward: ds = p * (dp - sum_d dout * out), the row term computed once.
    delta_BxKxGxT = jnp.sum(dout_BxKxGxTxD.astype(f32) * out.astype(f32), axis=-1)
    dout = dout_BxKxGxTxD.astype(q.dtype)
    dq_blocks = []
    dk_BxKxSxD = jnp.zeros(k.shape, f32)
    dv_BxKxSxD = jnp.zeros(v.shape, f32)
    for a, b in bounds:
        s_BxKxGxQxS = _block_scores(q, k, seg, prefix, a, b, scale, has_prefix)
        p_BxKxGxQxS = jnp.exp(s_BxKxGxQxS - lse_BxKxGxT[..., a:b, None])  # masked: exactly 0
        dout_b = dout[:, :, :, a:b]
        dv_BxKxSxD = dv_BxKxSxD.at[:, :, :b].add(
            jnp.einsum(
                "bkgts,bkgtd->bksd", p_BxKxGxQxS.astype(q.dtype), dout_b, preferred_element_type=f32
            )
        )
        dp_BxKxGxQxS = jnp.einsum(
            "bkgtd,bksd->bkgts", dout_b, v[:, :, :b], preferred_element_type=f32
        )
        ds = (p_BxKxGxQxS * (dp_BxKxGxQxS - delta_BxKxGxT[..., a:b, None]) * scale).astype(q.dtype)
        dq_blocks.append(
            jnp.einsum("bkgts,bksd->bkgtd", ds, k[:, :, :b], preferred_element_type=f32)
        )
        dk_BxKxSxD = dk_BxKxSxD.at[:, :, :b].add(
            jnp.einsum("bkgts,bkgtd->bksd", ds, q[:, :, :, a:b], preferred_element_type=f32)
        )
    dq = jnp.concatenate(dq_blocks, axis=3) if len(dq_blocks) > 1 else dq_blocks[0]
    # Segment and prefix ids are integers: no cotangent (None, a symbolic zero).
    return dq.astype(q.dtype), dk_BxKxSxD.astype(k.dtype), dv_BxKxSxD.astype(v.dtype), None, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
