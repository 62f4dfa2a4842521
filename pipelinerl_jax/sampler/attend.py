"""The sampler's attention hooks: paged K/V read from the pool, the new K/V handed back.

Why the page pool is closed over instead of travelling through the layers as a per-layer
cache slice: a cache scanned with the layers becomes a dynamic-slice per layer (a copy of the
layer's whole pool) and a stacked output (another copy), i.e. two copies of the entire pool per
decode step, measured here at ~0.2 s per step for a 134 MB pool. Instead each layer's attend
reads its pages with one gather from the closed-over pool (only the pages named in the slots'
block tables, only the first W of them) and returns the new K/V; the engine scatters all
layers' new K/V into the donated pool after the forward, in place.

Consequently the current tokens' K/V are not in the pages while attending: attention is over
(cached positions before the chunk) + (the chunk itself, causally), merged in one f32 softmax.
Every query may attend to itself, so padding queries stay finite and never write NaN K/V
into the null page; masked V rows are zeroed, not just given zero weight, so a corrupted page
could not leak NaN into a live row (0 * NaN = NaN).

The layer index arrives as a Python int (the sampler's forward is unrolled, see forward.py).

Pool layout [L, K, P, S, D] (kv head outside the page): one gather then yields each row's keys
head-major, [B, K, N, D], the layout in which the decode score and probability-times-V
reductions run at close to memory speed on XLA:CPU. Measured for 8 layers at batch 64 and
N = 160: scores + PV took 67 ms with position-major keys [B, N, K, D] (batched einsums) and
35 ms head-major (scores as a broadcast-multiply-reduce over D, PV as an einsum), against
12 ms to merely read K.

Dimension letters: B rows, T query tokens, H query heads, K kv heads, G = H / K, D head dim,
L layers, P pages per layer, S page size, W pages read per row (window), N = W * S.
"""

from __future__ import annotations

import jax.numpy as jnp


def _gather_old(pages_LxKxPxSxD, layer: int, block_tables_BxW):
    """This layer's pages named by the block tables, head-major -> [B, K, W*S, D]."""
    num_layers, kv_heads, num_pages, page_size, head_dim = pages_LxKxPxSxD.shape
    flat = pages_LxKxPxSxD.reshape(num_layers * kv_heads * num_pages, page_size, head_dim)
    heads_K = (layer * kv_heads + jnp.arange(kv_heads)) * num_pages
    rows_BxKxW = heads_K[None, :, None] + block_tables_BxW[:, None, :]
    batch, window = block_tables_BxW.shape
    # mode="clip": an out-of-range id must never gather NaN fill into a live computation.
    gathered = jnp.take(flat, rows_BxKxW, axis=0, mode="clip")
    return gathered.reshape(batch, kv_heads, window * page_size, head_dim)


def _merge_softmax(s_old, s_new, v_old, v_new, old_spec, new_spec):
    """f32 softmax over [old | new] scores (already -inf where masked), then @ V of each part.

    s_old/v_old may be None (nothing cached yet). Returns (unnormalised out, denominator).
    """
    row_max = jnp.max(s_new, axis=-1, keepdims=True)
    if s_old is not None:
        row_max = jnp.maximum(row_max, jnp.max(s_old, axis=-1, keepdims=True))
    p_new = jnp.exp(s_new - row_max)
    denom = jnp.sum(p_new, axis=-1)
    out = jnp.einsum(new_spec, p_new.astype(v_new.dtype), v_new,
                     preferred_element_type=jnp.float32)
    if s_old is not None:
        p_old = jnp.exp(s_old - row_max)
        denom = denom + jnp.sum(p_old, axis=-1)
        out = out + jnp.einsum(old_spec, p_old.astype(v_old.dtype), v_old,
                               preferred_element_type=jnp.float32)
    return out, denom


def decode_attend(k_pages, v_pages, block_tables_BxW, positions_B, *, scale: float):
    """attend() for one new token per row at `positions_B` (it sees positions < its own + itself).

    k_pages, v_pages: [L, K, P, S, D]. Returns attend(q_Bx1xHxD, k_Bx1xKxD, v_Bx1xKxD, layer)
    -> (out_Bx1xHxD, (k, v)).
    """
    window_positions_N = jnp.arange(block_tables_BxW.shape[1] * k_pages.shape[3])
    old_valid_BxN = window_positions_N[None, :] < positions_B[:, None]

    def attend(q_Bx1xHxD, k_Bx1xKxD, v_Bx1xKxD, layer):
        batch, _, heads, head_dim = q_Bx1xHxD.shape
        kv_heads = k_Bx1xKxD.shape[2]
        group = heads // kv_heads
        dtype = q_Bx1xHxD.dtype
        k_old_BxKxNxD = _gather_old(k_pages, layer, block_tables_BxW).astype(dtype)
        v_old_BxKxNxD = _gather_old(v_pages, layer, block_tables_BxW).astype(dtype)
        # Zeroed, not just given zero weight: 0 * NaN from a corrupted page would leak in.
        v_old_BxKxNxD = jnp.where(old_valid_BxN[:, None, :, None], v_old_BxKxNxD, 0)
        q_BxKxGxD = q_Bx1xHxD.reshape(batch, kv_heads, group, head_dim)
        # Multiply-and-reduce over D rather than a batched matmul of [G, D] x [D, N] blocks:
        # 2x faster here (module docstring).
        s_old = jnp.sum(q_BxKxGxD[:, :, :, None, :].astype(jnp.float32)
                        * k_old_BxKxNxD[:, :, None, :, :], axis=-1) * scale
        s_old = jnp.where(old_valid_BxN[:, None, None, :], s_old, -jnp.inf)
        s_new = jnp.sum(q_BxKxGxD.astype(jnp.float32)
                        * k_Bx1xKxD[:, 0, :, None, :], axis=-1)[..., None] * scale
        out_BxKxGxD, denom_BxKxG = _merge_softmax(
            s_old, s_new, v_old_BxKxNxD, v_Bx1xKxD[:, 0, :, None, :],
            "bkgn,bknd->bkgd", "bkgn,bknd->bkgd")
        out_BxKxGxD = out_BxKxGxD / denom_BxKxG[..., None]
        out = out_BxKxGxD.reshape(batch, 1, heads, head_dim).astype(dtype)
        return out, (k_Bx1xKxD, v_Bx1xKxD)

    return attend


def prefill_attend(k_pages, v_pages, block_tables_BxW, positions_BxT, *, scale: float):
    """attend() for a chunk of T tokens per row (padding at position -1, at the end of a row).

    A query at position p sees the row's cached positions before the chunk start and the
    chunk's own tokens at positions <= p. Returns (out_BxTxHxD, (k, v)).
    """
    start_B = positions_BxT[:, 0]   # chunk start; -1 for an all-padding row (sees nothing old)
    window_positions_N = jnp.arange(block_tables_BxW.shape[1] * k_pages.shape[3])
    old_valid_BxN = window_positions_N[None, :] < start_B[:, None]
    valid_BxT = positions_BxT >= 0
    tokens = positions_BxT.shape[1]
    causal_TxT = jnp.tril(jnp.ones((tokens, tokens), bool))
    new_valid_BxTxT = (causal_TxT[None] & valid_BxT[:, None, :]) | jnp.eye(tokens, dtype=bool)

    def attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layer):
        batch, _, heads, head_dim = q_BxTxHxD.shape
        kv_heads = k_BxTxKxD.shape[2]
        group = heads // kv_heads
        q_BxTxKxGxD = q_BxTxHxD.reshape(batch, tokens, kv_heads, group, head_dim)
        s_new = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxTxKxD,
                           preferred_element_type=jnp.float32) * scale
        s_new = jnp.where(new_valid_BxTxT[:, None, None], s_new, -jnp.inf)
        s_old = v_old = None   # first chunk: nothing cached yet
        if block_tables_BxW.shape[1]:
            k_old = _gather_old(k_pages, layer, block_tables_BxW).astype(q_BxTxHxD.dtype)
            v_old = _gather_old(v_pages, layer, block_tables_BxW).astype(q_BxTxHxD.dtype)
            v_old = jnp.where(old_valid_BxN[:, None, :, None], v_old, 0)
            s_old = jnp.einsum("btkgd,bknd->bkgtn", q_BxTxKxGxD, k_old,
                               preferred_element_type=jnp.float32) * scale
            s_old = jnp.where(old_valid_BxN[:, None, None, None, :], s_old, -jnp.inf)
        out_BxTxKxGxD, denom_BxKxGxT = _merge_softmax(
            s_old, s_new, v_old, v_BxTxKxD, "bkgtn,bknd->btkgd", "bkgts,bskd->btkgd")
        denom_BxTxKxG = jnp.moveaxis(denom_BxKxGxT, 3, 1)
        out_BxTxKxGxD = out_BxTxKxGxD / denom_BxTxKxG[..., None]
        out = out_BxTxKxGxD.reshape(batch, tokens, heads, head_dim).astype(q_BxTxHxD.dtype)
        return out, (k_BxTxKxD, v_BxTxKxD)

    return attend


def write_new_kv(pages_LxKxPxSxD, new_LxBxTxKxD, block_tables_BxM, positions_BxT, write_BxT):
    """Scatters every layer's new K (or V) at their positions; unwritten ones go to the null page.

    Rows/tokens with write False (inactive slots, padding) target page 0, offset 0: many
    writes of finite garbage to a page nobody reads unmasked.
    """
    page_size = pages_LxKxPxSxD.shape[3]
    safe_pos_BxT = jnp.where(write_BxT, positions_BxT, 0)
    block_BxT = jnp.clip(safe_pos_BxT // page_size, 0, block_tables_BxM.shape[1] - 1)
    page_BxT = jnp.take_along_axis(block_tables_BxM, block_BxT, axis=1)
    page_BxT = jnp.where(write_BxT, page_BxT, 0)
    offset_BxT = jnp.where(write_BxT, safe_pos_BxT % page_size, 0)
    new_LxKxBxTxD = jnp.moveaxis(new_LxBxTxKxD, 3, 1)
    return pages_LxKxPxSxD.at[:, :, page_BxT, offset_BxT].set(
        new_LxKxBxTxD.astype(pages_LxKxPxSxD.dtype))
