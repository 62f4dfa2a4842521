"""Pure-jnp paged attention: the CPU production path and the oracle for the Triton kernel.

The KV cache is a pool of pages shared by all sequences; each sequence owns a list of page
indices (its block table row). Attention gathers only the pages a sequence's table names,
reshapes query heads into (kv head, group) so GQA never repeats K/V, computes an f32 softmax
masked by length, and returns in the query dtype.

Dimension letters:
  B batch (sequences)       T query tokens per sequence (prefill chunk)
  H query heads = K * G      K kv heads        G query heads per kv head (GQA group)
  D head dim                 P pages in pool   S tokens per page (page size)
  M pages per sequence (block-table width)     L = M * S gathered cache positions

Garbage safety: block-table entries past a sequence's pages and cache slots past its length may
hold anything, NaN included. Masked scores are replaced (not multiplied) and masked V rows are
zeroed with jnp.where before the second matmul, because 0 * NaN = NaN would poison the sum.
"""

import jax
import jax.numpy as jnp


class PagedAttentionShapeError(ValueError):
    """Raised when the tensors handed to paged attention disagree in shape or dtype."""


def check_paged_inputs(q_shape, k_pages, v_pages, block_tables, *, where: str) -> tuple:
    """Validates the cache and block tables against the query head count; returns (K, G, S, D).

    q_shape ends in (H, D). Shapes are static under jit, so this costs nothing at run time.
    """
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise PagedAttentionShapeError(
            f"{where}: k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} must both "
            "be [pages, page_size, kv_heads, head_dim] with equal shapes")
    if k_pages.dtype != v_pages.dtype:
        raise PagedAttentionShapeError(
            f"{where}: k_pages dtype {k_pages.dtype} != v_pages dtype {v_pages.dtype}; store K and V "
            "in one dtype")
    _, page_size, kv_heads, head_dim = k_pages.shape
    num_heads, q_head_dim = q_shape[-2], q_shape[-1]
    if q_head_dim != head_dim:
        raise PagedAttentionShapeError(
            f"{where}: query head_dim {q_head_dim} != cache head_dim {head_dim}")
    if num_heads % kv_heads:
        raise PagedAttentionShapeError(
            f"{where}: {num_heads} query heads is not a multiple of {kv_heads} kv heads (GQA "
            "needs H = G * K)")
    if block_tables.ndim != 2 or block_tables.shape[0] != q_shape[0]:
        raise PagedAttentionShapeError(
            f"{where}: block_tables {tuple(block_tables.shape)} must be [batch={q_shape[0]}, "
            "pages_per_sequence]")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise PagedAttentionShapeError(
            f"{where}: block_tables dtype {block_tables.dtype} must be an integer type")
    return kv_heads, num_heads // kv_heads, page_size, head_dim


def _gather_pages(pages_PxSxKxD, block_tables_BxM):
    """[P, S, K, D] pages -> [B, M*S, K, D]: each sequence's own pages, in table order."""
    num_pages = pages_PxSxKxD.shape[0]
    # Garbage table entries may be out of range; clip so the gather is defined (masked later).
    idx_BxM = jnp.clip(block_tables_BxM, 0, num_pages - 1)
    gathered_BxMxSxKxD = jnp.take(pages_PxSxKxD, idx_BxM, axis=0)
    b, m, s, k, d = gathered_BxMxSxKxD.shape
    return gathered_BxMxSxKxD.reshape(b, m * s, k, d)


@jax.named_call
def paged_decode_attention_ref(q_BxHxD, k_pages_PxSxKxD, v_pages_PxSxKxD, block_tables_BxM,
                               lengths_B, *, scale):
    """One query token per sequence attending to its first lengths_B cached positions.

    Returns [B, H, D] in q's dtype; a length of 0 gives zeros.
    """
    if q_BxHxD.ndim != 3:
        raise PagedAttentionShapeError(
            f"paged_decode_attention: q {tuple(q_BxHxD.shape)} must be [batch, heads, head_dim]")
    if lengths_B.shape != (q_BxHxD.shape[0],):
        raise PagedAttentionShapeError(
            f"paged_decode_attention: lengths {tuple(lengths_B.shape)} must be [batch="
            f"{q_BxHxD.shape[0]}]")
    kv_heads, group, _, head_dim = check_paged_inputs(
        q_BxHxD.shape, k_pages_PxSxKxD, v_pages_PxSxKxD, block_tables_BxM,
        where="paged_decode_attention")
    batch = q_BxHxD.shape[0]

    k_BxLxKxD = _gather_pages(k_pages_PxSxKxD, block_tables_BxM)
    v_BxLxKxD = _gather_pages(v_pages_PxSxKxD, block_tables_BxM)
    num_pos = k_BxLxKxD.shape[1]
    valid_BxL = jnp.arange(num_pos)[None, :] < lengths_B[:, None]
    # Zero unused V rows so masked probabilities (exact zeros) never meet a NaN.
    v_BxLxKxD = jnp.where(valid_BxL[:, :, None, None], v_BxLxKxD, 0)

    q_BxKxGxD = q_BxHxD.reshape(batch, kv_heads, group, head_dim)
    s_BxKxGxL = jnp.einsum("bkgd,blkd->bkgl", q_BxKxGxD, k_BxLxKxD,
                           preferred_element_type=jnp.float32) * jnp.float32(scale)
    out_BxKxGxD = _masked_softmax_pv(s_BxKxGxL, valid_BxL[:, None, None, :], v_BxLxKxD,
                                     "bkgl,blkd->bkgd")
    return out_BxKxGxD.reshape(batch, kv_heads * group, head_dim).astype(q_BxHxD.dtype)


@jax.named_call
def paged_prefill_attention_ref(q_BxTxHxD, k_pages_PxSxKxD, v_pages_PxSxKxD, block_tables_BxM,
                                q_positions_BxT, *, scale):
    """Causal chunked prefill: the query at absolute position p sees cached positions 0..p.

    The chunk's own K/V must already be written into the pages. Padding queries carry position
    -1 and get zeros. Returns [B, T, H, D] in q's dtype.
    """
    if q_BxTxHxD.ndim != 4:
        raise PagedAttentionShapeError(
            f"paged_prefill_attention: q {tuple(q_BxTxHxD.shape)} must be [batch, tokens, heads, "
            "head_dim]")
    if q_positions_BxT.shape != q_BxTxHxD.shape[:2]:
        raise PagedAttentionShapeError(
            f"paged_prefill_attention: q_positions {tuple(q_positions_BxT.shape)} must be "
            f"[batch, tokens]={tuple(q_BxTxHxD.shape[:2])}")
    kv_heads, group, _, head_dim = check_paged_inputs(
        q_BxTxHxD.shape, k_pages_PxSxKxD, v_pages_PxSxKxD, block_tables_BxM,
        where="paged_prefill_attention")
    batch, tokens = q_BxTxHxD.shape[:2]

    k_BxLxKxD = _gather_pages(k_pages_PxSxKxD, block_tables_BxM)
    v_BxLxKxD = _gather_pages(v_pages_PxSxKxD, block_tables_BxM)
    pos_L = jnp.arange(k_BxLxKxD.shape[1])
    valid_BxTxL = pos_L[None, None, :] <= q_positions_BxT[:, :, None]
    # Every position any query of the sequence may see is <= its largest query position.
    last_B = jnp.max(q_positions_BxT, axis=1)
    v_BxLxKxD = jnp.where((pos_L[None, :] <= last_B[:, None])[:, :, None, None], v_BxLxKxD, 0)

    q_BxTxKxGxD = q_BxTxHxD.reshape(batch, tokens, kv_heads, group, head_dim)
    s_BxKxGxTxL = jnp.einsum("btkgd,blkd->bkgtl", q_BxTxKxGxD, k_BxLxKxD,
                             preferred_element_type=jnp.float32) * jnp.float32(scale)
    out_BxTxKxGxD = _masked_softmax_pv(s_BxKxGxTxL, valid_BxTxL[:, None, None, :, :], v_BxLxKxD,
                                       "bkgtl,blkd->btkgd")
    return out_BxTxKxGxD.reshape(batch, tokens, kv_heads * group, head_dim).astype(
        q_BxTxHxD.dtype)


def _masked_softmax_pv(scores, valid, v_BxLxKxD, pv_spec):
    """f32 softmax over the last axis restricted to `valid`, then probabilities @ V.

    Rows with nothing valid give zeros. jnp.where (not multiplication) keeps NaN scores from
    garbage pages out of the max, the exponentials and the sum.
    """
    scores = jnp.where(valid, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(valid, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(probs, axis=-1)
    # Probabilities stay f32 (the oracle should not round them); V is promoted.
    out = jnp.einsum(pv_spec, probs, v_BxLxKxD.astype(jnp.float32),
                     preferred_element_type=jnp.float32)
    # denom's axes (b k g [t]) are out's leading axes in decode; prefill's out is b t k g d.
    if pv_spec.endswith("btkgd"):
        denom = jnp.moveaxis(denom, 3, 1)
    denom = denom[..., None]
    return jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
