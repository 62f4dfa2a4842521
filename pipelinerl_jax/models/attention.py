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

import math

import jax
import jax.numpy as jnp

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
    Letters: B rows, T tokens, S keys, H query heads, K kv heads, G = H/K, D head dim.
    """
    seg_BxT = segment_ids_BxT
    T = seg_BxT.shape[1]
    num = min(max(1, math.ceil(T / max(block, 1))), 16)
    size = math.ceil(T / num)

    def attend(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, layer_cache):
        B, _, H, D = q_BxTxHxD.shape
        K = k_BxSxKxD.shape[2]
        q_BxKxGxTxD = q_BxTxHxD.reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
        k_BxKxSxD = k_BxSxKxD.transpose(0, 2, 1, 3)
        v_BxKxSxD = v_BxSxKxD.transpose(0, 2, 1, 3)
        outs = []
        for a in range(0, T, size):
            b = min(a + size, T)
            s = jnp.einsum(
                "bkgtd,bksd->bkgts",
                q_BxKxGxTxD[:, :, :, a:b],
                k_BxKxSxD[:, :, :b],
                preferred_element_type=jnp.float32,
            ) * (1.0 / math.sqrt(D))
            mask_BxQxS = segment_visible(seg_BxT, prefix_ids_BxT, slice(a, b), slice(0, b))
            s = jnp.where(mask_BxQxS[:, None, None], s, jnp.finfo(jnp.float32).min)
            p = jax.nn.softmax(s, axis=-1).astype(v_BxKxSxD.dtype)
            outs.append(jnp.einsum("bkgts,bksd->bkgtd", p, v_BxKxSxD[:, :, :b]))
        out_BxKxGxTxD = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
        return out_BxKxGxTxD.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D), layer_cache

    return attend
