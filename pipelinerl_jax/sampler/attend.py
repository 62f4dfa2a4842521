"""The sampler's attention hooks over the paged KV pool, and the writes into it.

Every hook here has the signature forward.forward_hidden expects,
attend(q, k, v, (layer, (k_pages, v_pages))) -> (out, (layer, (k_pages, v_pages))):
the whole pool [L, P, K, S, D] travels through the layers as attend's carry, and each layer
writes its new K/V into its own slice of the pool in place, then reads its pages. Always in
that order: a read of the pool before its in-place write makes XLA copy the pool first (on
the 2-layer model of tests/test_sampler_strategies.py: 4 whole-pool copies per prefill and 6
per 4-step "gather" decode chunk, none written first).

Why the whole pool rather than a per-layer cache slice scanned with the layers: a sliced cache
becomes a dynamic-slice per layer (a copy of the layer's pool) and a stacked output (another
copy), i.e. two copies of the entire pool per decode step, measured here at ~0.2 s per step for
a 134 MB pool. A carried pool is read with one gather per layer (only the pages named in the
rows' block tables, only the first W of them) and written with one in-place scatter. The layer
index may be a Python int (an unrolled forward) or a traced int32 (a scan over layers): both
only offset page ids and index the pool's leading axis.

Hooks (the decode strategies in strategies.py pick among them):
- `decode_attend_paged`: writes the token's K/V first, then calls the one paged attention
  dispatcher (`kernels.paged_decode_attention`: the Triton kernel on NVIDIA GPUs, its jnp
  reference elsewhere) on the pool flattened to [L*P, K, S, D] with block tables offset by
  layer * P, the kernel's layout, so nothing is copied.
- `decode_attend` ("gather"): writes the token's K/V, reads the pages' positions before it
  and merges the token's own K/V into one f32 softmax.
- `prefill_attend`: the same for a chunk of T prompt tokens per row, causally within the chunk.

Every query may attend to itself, so padding queries stay finite and never write NaN K/V into
the null page; masked V rows are zeroed, not just given zero weight, so a corrupted page could
not leak NaN into a live row (0 * NaN = NaN).

Writes go through a `scatter` (array, index, values, dtype=None, **at_kwargs) -> array:
`plain_set` (`.at[].set` in the pool dtype, what the GPU strategy uses) or `set_at` (16-bit
floats written as their uint16 bit patterns, a CPU trick; it says why).

Within a page the kv heads are major ([K, S, D], see kernels/paged_attention_ref.py): a
gathered [B, W, K, S, D] block feeds the score and value dots with no transposed copy.

Dimension letters (pipelinerl_jax/__init__.py):
B rows, T query tokens, H query heads, K kv heads, G = H / K, D head dim,
L layers, P pages per layer, S page size, M pages per row (block-table width), W pages read
per row (window), N = W * S.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipelinerl_jax.kernels.paged_attention import paged_decode_attention


def _gather_old(pages_LxPxKxSxD, layer, block_tables_BxW):
    """This layer's pages named by the block tables -> [B, W, K, S, D]."""
    num_layers, num_pages = pages_LxPxKxSxD.shape[:2]
    flat = pages_LxPxKxSxD.reshape((num_layers * num_pages,) + pages_LxPxKxSxD.shape[2:])
    # mode="clip": an out-of-range id must never gather NaN fill into a live computation.
    return jnp.take(flat, block_tables_BxW + layer * num_pages, axis=0, mode="clip")


def _merge_softmax(s_old, s_new, v_old, v_new, old_spec, new_spec):
    """f32 softmax over [old | new] scores (already -inf where masked), then @ V of each part.

    s_new ends in one key axis; s_old ends in two (window page, slot in page) and has s_new's
    leading axes. s_old/v_old may be None (nothing cached yet). Returns (unnormalised out,
    denominator).
    """
    row_max = jnp.max(s_new, axis=-1)
    if s_old is not None:
        row_max = jnp.maximum(row_max, jnp.max(s_old, axis=(-2, -1)))
    p_new = jnp.exp(s_new - row_max[..., None])
    denom = jnp.sum(p_new, axis=-1)
    out = jnp.einsum(new_spec, p_new.astype(v_new.dtype), v_new, preferred_element_type=jnp.float32)
    if s_old is not None:
        p_old = jnp.exp(s_old - row_max[..., None, None])
        denom = denom + jnp.sum(p_old, axis=(-2, -1))
        out = out + jnp.einsum(
            old_spec, p_old.astype(v_old.dtype), v_old, preferred_element_type=jnp.float32
        )
    return out, denom


def _window_valid(window: int, page_size: int, before_B):
    """[B, W, S] bool: window position < before_B (the row's cached positions)."""
    window_positions_WxS = jnp.arange(window * page_size).reshape(window, page_size)
    return window_positions_WxS[None] < before_B[:, None, None]


def decode_attend(
    block_tables_BxM, positions_B, write_B, window: int, *, scale: float, scatter, cache_dtype=None
):
    """attend() for one new token per row at `positions_B` (it sees positions < its own + itself).

    Writes the token's K/V into the layer's pages with `scatter` (rows with write False,
    inactive slots, write to the null page), reads the positions before the token from the
    first `window` pages of each row, and merges the token's own K/V into the same softmax.
    cache_dtype: the float dtype the pool holds when it is stored as its bits (`pool_dtype`).
    """
    batch = block_tables_BxM.shape[0]
    block_tables_BxW = block_tables_BxM[:, :window]

    def attend(q_Bx1xHxD, k_Bx1xKxD, v_Bx1xKxD, layer_and_pages):
        layer, (k_pages, v_pages) = layer_and_pages
        heads, head_dim = q_Bx1xHxD.shape[2:]
        kv_heads = k_Bx1xKxD.shape[2]
        group = heads // kv_heads
        f32 = jnp.float32
        dtype = cache_dtype or k_pages.dtype
        # Written first, read after: the reads only see positions < the token's (masked
        # below), and a read of the pool before its in-place write would make XLA copy it.
        at = (block_tables_BxM, positions_B[:, None], write_B[:, None])
        k_pages = write_layer_kv(k_pages, layer, k_Bx1xKxD, *at, scatter=scatter, dtype=dtype)
        v_pages = write_layer_kv(v_pages, layer, v_Bx1xKxD, *at, scatter=scatter, dtype=dtype)
        old_valid_BxWxS = _window_valid(window, k_pages.shape[3], positions_B)
        k_old_BxWxKxSxD = values_of(_gather_old(k_pages, layer, block_tables_BxW), dtype, f32)
        v_old_BxWxKxSxD = values_of(_gather_old(v_pages, layer, block_tables_BxW), dtype, f32)
        # Zeroed, not just given zero weight: 0 * NaN from a corrupted page would leak in.
        v_old_BxWxKxSxD = jnp.where(old_valid_BxWxS[:, :, None, :, None], v_old_BxWxKxSxD, 0)
        q_BxKxGxD = q_Bx1xHxD.reshape(batch, kv_heads, group, head_dim).astype(f32)
        # The token's own K/V rounded as the pool stores it: it attends to itself exactly as
        # later steps (and the strategies that write before reading) see it. Both dots in f32
        # (probabilities not rounded to a 16-bit V), as the other strategies compute them.
        k_Bx1xKxD = k_Bx1xKxD.astype(dtype)
        v_Bx1xKxD = v_Bx1xKxD.astype(dtype)
        s_old_BxKxGxWxS = (
            jnp.einsum(
                "bkgd,bwksd->bkgws",
                q_BxKxGxD,
                k_old_BxWxKxSxD,
                preferred_element_type=f32,
            )
            * scale
        )
        s_old_BxKxGxWxS = jnp.where(old_valid_BxWxS[:, None, None], s_old_BxKxGxWxS, -jnp.inf)
        s_new_BxKxGx1 = (
            jnp.sum(q_BxKxGxD * k_Bx1xKxD[:, 0, :, None, :].astype(f32), axis=-1)[..., None] * scale
        )
        out_BxKxGxD, denom_BxKxG = _merge_softmax(
            s_old_BxKxGxWxS,
            s_new_BxKxGx1,
            v_old_BxWxKxSxD,
            v_Bx1xKxD[:, 0, :, None, :].astype(f32),
            "bkgws,bwksd->bkgd",
            "bkgn,bknd->bkgd",
        )
        out_BxKxGxD = out_BxKxGxD / denom_BxKxG[..., None]
        out = out_BxKxGxD.reshape(batch, 1, heads, head_dim).astype(q_Bx1xHxD.dtype)
        return out, (layer, (k_pages, v_pages))

    return attend


def decode_attend_paged(
    block_tables_BxM,
    positions_B,
    write_B,
    window: int,
    *,
    scale: float,
    impl: str = "auto",
    scatter=None,
):
    """attend() that writes the token's K/V into the pool, then runs paged decode attention.

    Rows with write False (inactive slots) write to the null page. scatter: `plain_set` unless
    given (this is the GPU path: plain JAX and the kernel).
    """
    scatter = scatter or plain_set

    def attend(q_Bx1xHxD, k_Bx1xKxD, v_Bx1xKxD, layer_and_pages):
        layer, (k_pages, v_pages) = layer_and_pages
        num_layers, num_pages = k_pages.shape[:2]
        at = (block_tables_BxM, positions_B[:, None], write_B[:, None])
        k_pages = write_layer_kv(k_pages, layer, k_Bx1xKxD, *at, scatter=scatter)
        v_pages = write_layer_kv(v_pages, layer, v_Bx1xKxD, *at, scatter=scatter)
        flat = (num_layers * num_pages,) + k_pages.shape[2:]
        out_BxHxD = paged_decode_attention(
            q_Bx1xHxD[:, 0],
            k_pages.reshape(flat),
            v_pages.reshape(flat),
            block_tables_BxM[:, :window] + layer * num_pages,
            positions_B + 1,
            scale=scale,
            impl=impl,
        )
        return out_BxHxD[:, None], (layer, (k_pages, v_pages))

    return attend


def prefill_attend(
    block_tables_BxM, window: int, positions_BxT, *, scale: float, scatter, cache_dtype=None
):
    """attend() for a chunk of T tokens per row (padding at position -1, at the end of a row).

    The chunk's K/V is written into the layer's pages (padding: the null page); a query at
    position p sees the row's cached positions before the chunk start (read from its first
    `window` pages; 0 for a first chunk) and the chunk's own tokens at positions <= p.
    cache_dtype: as in decode_attend.
    """
    start_B = positions_BxT[:, 0]  # chunk start; -1 for an all-padding row (sees nothing old)
    block_tables_BxW = block_tables_BxM[:, :window]
    valid_BxT = positions_BxT >= 0
    tokens = positions_BxT.shape[1]
    causal_TxT = jnp.tril(jnp.ones((tokens, tokens), bool))
    new_valid_BxTxT = (causal_TxT[None] & valid_BxT[:, None, :]) | jnp.eye(tokens, dtype=bool)

    def attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layer_and_pages):
        layer, (k_pages, v_pages) = layer_and_pages
        batch, _, heads, head_dim = q_BxTxHxD.shape
        kv_heads = k_BxTxKxD.shape[2]
        group = heads // kv_heads
        q_BxTxKxGxD = q_BxTxHxD.reshape(batch, tokens, kv_heads, group, head_dim)
        s_new = (
            jnp.einsum(
                "btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxTxKxD, preferred_element_type=jnp.float32
            )
            * scale
        )
        s_new = jnp.where(new_valid_BxTxT[:, None, None], s_new, -jnp.inf)
        # Written first, read after (as in decode_attend: the reads are masked to positions
        # before the chunk, and reading before the in-place write would copy the pool).
        dtype = cache_dtype or k_pages.dtype
        at = (block_tables_BxM, positions_BxT, valid_BxT)
        k_pages = write_layer_kv(k_pages, layer, k_BxTxKxD, *at, scatter=scatter, dtype=dtype)
        v_pages = write_layer_kv(v_pages, layer, v_BxTxKxD, *at, scatter=scatter, dtype=dtype)
        s_old = v_old = None  # first chunk: nothing cached yet
        if window:
            old_valid_BxWxS = _window_valid(window, k_pages.shape[3], start_B)
            k_old = values_of(_gather_old(k_pages, layer, block_tables_BxW), dtype, q_BxTxHxD.dtype)
            v_old = values_of(_gather_old(v_pages, layer, block_tables_BxW), dtype, q_BxTxHxD.dtype)
            v_old = jnp.where(old_valid_BxWxS[:, :, None, :, None], v_old, 0)
            s_old = (
                jnp.einsum(
                    "btkgd,bwksd->bkgtws", q_BxTxKxGxD, k_old, preferred_element_type=jnp.float32
                )
                * scale
            )
            s_old = jnp.where(old_valid_BxWxS[:, None, None, None], s_old, -jnp.inf)
        out_BxTxKxGxD, denom_BxKxGxT = _merge_softmax(
            s_old, s_new, v_old, v_BxTxKxD, "bkgtws,bwksd->btkgd", "bkgts,bskd->btkgd"
        )
        denom_BxTxKxG = jnp.moveaxis(denom_BxKxGxT, 3, 1)
        out_BxTxKxGxD = out_BxTxKxGxD / denom_BxTxKxG[..., None]
        out = out_BxTxKxGxD.reshape(batch, tokens, heads, head_dim).astype(q_BxTxHxD.dtype)
        return out, (layer, (k_pages, v_pages))

    return attend


# --- writes -------------------------------------------------------------------------------


def plain_set(array, index, values, *, dtype=None, **at_kwargs):
    """`array.at[index].set(values)` in the array's dtype (`dtype` is accepted and ignored:
    a plain array is never a bit view)."""
    del dtype
    return array.at[index].set(values.astype(array.dtype), **at_kwargs)


def _is_half(dtype) -> bool:
    """bf16 / fp16: the float dtypes XLA:CPU cannot scatter."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2


def bits_view(x):
    """A 16-bit float array as its uint16 bit patterns (other arrays unchanged)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if _is_half(x.dtype) else x


def float_view(x, dtype):
    """Inverse of `bits_view` for values of float `dtype` (other arrays unchanged)."""
    if x.dtype == jnp.uint16 and _is_half(dtype):
        return jax.lax.bitcast_convert_type(x, dtype)
    return x


def pool_dtype(cache_dtype, *, as_bits: bool):
    """The dtype a page pool of `cache_dtype` values is stored in: a 16-bit float pool as its
    uint16 bits when `as_bits` (the CPU strategies: XLA:CPU has no 16-bit float scatter, see
    `set_at`, and converting a pool between its two views is a copy of the whole pool)."""
    dtype = jnp.dtype(cache_dtype)
    return jnp.dtype(jnp.uint16) if as_bits and _is_half(dtype) else dtype


def values_of(x, dtype, out_dtype):
    """Pool values of float `dtype` as `out_dtype`, from the array or from its `bits_view`."""
    if x.dtype == jnp.uint16 and _is_half(dtype):
        return f32_of(x, dtype).astype(out_dtype)
    return x.astype(out_dtype)


def f32_of(x, dtype):
    """Values of float `dtype` as f32, from the array or from its `bits_view`.

    bf16 bit patterns widen with a shift: an integer op XLA fuses into the dot that reads the
    stage, where `float_view` is a bitcast-convert that XLA:CPU materialises as a copy of the
    whole stage per layer and step (bench_decode_real, bf16 batch 64: ~13% of a step).
    """
    if x.dtype == jnp.uint16 and jnp.dtype(dtype) == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    return float_view(x, dtype).astype(jnp.float32)


def set_at(array, index, values, *, dtype=None, **at_kwargs):
    """`array.at[index].set(values)` that writes 16-bit floats as their 16-bit patterns (CPU).

    Why: XLA:CPU has no bf16/fp16 scatter, so it upcasts the whole destination to f32,
    scatters and converts it back: for a bf16 page pool that is two full copies of the pool per
    written layer. On the bench model (bf16, batch 64, a 42 MB pool per layer) those copies
    took ~85% of a decode step. A uint16 scatter of the same bits is exact and in place.

    dtype: the float dtype `array` holds when it is already a `bits_view` (the CPU strategies
    store 16-bit pools that way, so no view of a pool is a copy made per call).
    """
    dtype = jnp.dtype(dtype or array.dtype)
    values = values.astype(dtype)
    if not _is_half(dtype):
        return array.at[index].set(values, **at_kwargs)
    updated = bits_view(array).at[index].set(bits_view(values), **at_kwargs)
    return float_view(updated, array.dtype)


def _targets(page_size, block_tables_BxM, positions_BxT, write_BxT):
    """(page, offset) per token; unwritten tokens target the null page, offset 0."""
    safe_pos_BxT = jnp.where(write_BxT, positions_BxT, 0)
    block_BxT = jnp.clip(safe_pos_BxT // page_size, 0, block_tables_BxM.shape[1] - 1)
    page_BxT = jnp.take_along_axis(block_tables_BxM, block_BxT, axis=1)
    return jnp.where(write_BxT, page_BxT, 0), jnp.where(write_BxT, safe_pos_BxT % page_size, 0)


def write_layer_kv(
    pages_LxPxKxSxD,
    layer,
    new_BxTxKxD,
    block_tables_BxM,
    positions_BxT,
    write_BxT,
    *,
    scatter,
    dtype=None,
):
    """Scatters one layer's new K (or V) at their positions with `scatter`; dtype as `set_at`.

    Rows/tokens with write False (inactive slots, padding) target page 0, offset 0: many
    writes of finite garbage to a page nobody reads unmasked. The page and offset indices are
    split by the kv-head axis, so (numpy rules) the indexed view is [B, T, K, D], as new is.
    """
    page_BxT, offset_BxT = _targets(
        pages_LxPxKxSxD.shape[3], block_tables_BxM, positions_BxT, write_BxT
    )
    index = (layer, page_BxT, slice(None), offset_BxT)
    return scatter(pages_LxPxKxSxD, index, new_BxTxKxD, dtype=dtype)
