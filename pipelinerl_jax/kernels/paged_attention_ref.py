"""Pure-jnp paged attention: the "paged" strategy off GPUs, and the oracle for the Triton kernel.

The KV cache is a pool of pages shared by all sequences; each sequence owns a list of page
indices (its block table row). Attention gathers only the pages a sequence's table names,
reshapes query heads into (kv head, group) so GQA never repeats K/V, computes an f32 softmax
masked by length, and returns in the query dtype. Decode gathers the pages in blocks sized for
the CPU cache, combined by an online softmax (one block, no scan, at batch 1).

Page layout [P, K, S, D] (kv-head major inside a page, as vLLM's original paged attention):
a gathered block [B, C, K, S, D] already has each (sequence, kv head)'s tokens as contiguous
[S, D] rows, so XLA:CPU runs the score and value dots on it directly. With the [P, S, K, D]
layout used before, XLA copied every gathered block into a transposed [B, K, D, N] buffer
first, which cost about as much as the attention itself
(docs/cpu_measurements.md#page-layout).
The Triton kernel reads either layout through its strides.

Dimension letters (pipelinerl_jax/__init__.py):
  B batch (sequences)       T query tokens per sequence (prefill chunk)
  H query heads = K * G      K kv heads        G query heads per kv head (GQA group)
  D head dim                 P pages in pool   S tokens per page (page size)
  M pages per sequence (block-table width)     C pages per decode block (M * S positions)

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
            "be [pages, kv_heads, page_size, head_dim] with equal shapes"
        )
    if k_pages.dtype != v_pages.dtype:
        raise PagedAttentionShapeError(
            f"{where}: k_pages dtype {k_pages.dtype} != v_pages dtype {v_pages.dtype}; store K and V "
            "in one dtype"
        )
    _, kv_heads, page_size, head_dim = k_pages.shape
    num_heads, q_head_dim = q_shape[-2], q_shape[-1]
    if q_head_dim != head_dim:
        raise PagedAttentionShapeError(
            f"{where}: query head_dim {q_head_dim} != cache head_dim {head_dim}"
        )
    if num_heads % kv_heads:
        raise PagedAttentionShapeError(
            f"{where}: {num_heads} query heads is not a multiple of {kv_heads} kv heads (GQA "
            "needs H = G * K)"
        )
    if block_tables.ndim != 2 or block_tables.shape[0] != q_shape[0]:
        raise PagedAttentionShapeError(
            f"{where}: block_tables {tuple(block_tables.shape)} must be [batch={q_shape[0]}, "
            "pages_per_sequence]"
        )
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise PagedAttentionShapeError(
            f"{where}: block_tables dtype {block_tables.dtype} must be an integer type"
        )
    return kv_heads, num_heads // kv_heads, page_size, head_dim


def _gather_pages(pages_PxKxSxD, block_tables_BxM):
    """[P, K, S, D] pages -> [B, M, K, S, D]: each sequence's own pages, in table order."""
    # Garbage table entries may be out of range: clip so the gather is defined (masked later;
    # the default "fill" mode would also cost a bounds select per element).
    return jnp.take(pages_PxKxSxD, block_tables_BxM, axis=0, mode="clip")


# Decode gathers all of a sequence's pages in one block while the gathered K and V are small
# and in blocks of about STEP_BYTES (combined by an online softmax) beyond that, so a long
# context never materialises a copy of the whole cache. The thresholds are where one block
# stopped winning on CPU (docs/cpu_measurements.md#paged-reference-blocks).
SINGLE_BLOCK_BYTES = 24 << 20
STEP_BYTES = 4 << 20
MIN_STEP_TOKENS = 32


def decode_pages_per_step(batch, page_size, pages_per_seq, kv_heads, head_dim, itemsize) -> int:
    """Pages gathered per online-softmax step of the decode reference (static)."""
    page_bytes = 2 * batch * page_size * kv_heads * head_dim * itemsize  # K and V, all rows
    if page_bytes * pages_per_seq <= SINGLE_BLOCK_BYTES:
        return int(pages_per_seq)
    pages = max(-(-MIN_STEP_TOKENS // page_size), STEP_BYTES // page_bytes)
    return int(min(pages_per_seq, max(1, pages)))


@jax.named_call
def paged_decode_attention_ref(
    q_BxHxD,
    k_pages_PxKxSxD,
    v_pages_PxKxSxD,
    block_tables_BxM,
    lengths_B,
    *,
    scale,
    pages_per_step=None,
    round_probs_dtype=None,
):
    """One query token per sequence attending to its first lengths_B cached positions.

    Returns [B, H, D] in q's dtype; a length of 0 gives zeros. Positions past the table's
    M * S slots do not exist. pages_per_step (default: decode_pages_per_step) only changes how
    the work is blocked, not the result beyond f32 rounding.

    round_probs_dtype (default None: the probabilities stay f32) rounds each step's
    probabilities to that dtype (and back to f32) right before the probability x V dot, as the
    Triton kernel does for 16-bit caches (`p.to(v.dtype)`); the softmax denominator still sums
    the unrounded probabilities, as in the kernel. The probabilities are relative to the running
    max of the step they are computed in, so the rounding depends on the blocking: with
    pages_per_step = BLOCK_N / page_size the reference reproduces the kernel's rounding (up to
    f32 rounding of the scores). Only the kernel tests need it; production uses the default.
    """
    if q_BxHxD.ndim != 3:
        raise PagedAttentionShapeError(
            f"paged_decode_attention: q {tuple(q_BxHxD.shape)} must be [batch, heads, head_dim]"
        )
    if lengths_B.shape != (q_BxHxD.shape[0],):
        raise PagedAttentionShapeError(
            f"paged_decode_attention: lengths {tuple(lengths_B.shape)} must be [batch="
            f"{q_BxHxD.shape[0]}]"
        )
    kv_heads, group, page_size, head_dim = check_paged_inputs(
        q_BxHxD.shape,
        k_pages_PxKxSxD,
        v_pages_PxKxSxD,
        block_tables_BxM,
        where="paged_decode_attention",
    )
    batch, pages_per_seq = block_tables_BxM.shape
    if pages_per_step is None:
        pages_per_step = decode_pages_per_step(
            batch,
            page_size,
            pages_per_seq,
            kv_heads,
            head_dim,
            jnp.dtype(k_pages_PxKxSxD.dtype).itemsize,
        )
    pages_per_step = max(1, min(int(pages_per_step), pages_per_seq))
    num_steps = -(-pages_per_seq // pages_per_step)
    lengths_B = jnp.minimum(lengths_B, pages_per_seq * page_size)

    q_BxKxGxD = q_BxHxD.reshape(batch, kv_heads, group, head_dim)
    carry = (
        jnp.full((batch, kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((batch, kv_heads, group), jnp.float32),
        jnp.zeros((batch, kv_heads, group, head_dim), jnp.float32),
    )

    def step(carry, xs):
        tables_BxC, first_pos = xs
        return _decode_step(
            carry,
            q_BxKxGxD,
            k_pages_PxKxSxD,
            v_pages_PxKxSxD,
            tables_BxC,
            first_pos,
            lengths_B,
            scale,
            round_probs_dtype,
        ), None

    if num_steps == 1:
        carry, _ = step(carry, (block_tables_BxM, 0))
    else:
        # Pad the table to whole steps; padded positions lie past every length (masked).
        padded_BxM = jnp.pad(
            block_tables_BxM, ((0, 0), (0, num_steps * pages_per_step - pages_per_seq))
        )
        tables_NxBxC = padded_BxM.reshape(batch, num_steps, pages_per_step).transpose(1, 0, 2)
        first_pos_N = jnp.arange(num_steps) * pages_per_step * page_size
        carry, _ = jax.lax.scan(step, carry, (tables_NxBxC, first_pos_N))
    _, denom_BxKxG, acc_BxKxGxD = carry
    denom_BxKxGx1 = denom_BxKxG[..., None]
    out_BxKxGxD = jnp.where(
        denom_BxKxGx1 > 0, acc_BxKxGxD / jnp.where(denom_BxKxGx1 > 0, denom_BxKxGx1, 1.0), 0.0
    )
    return out_BxKxGxD.reshape(batch, kv_heads * group, head_dim).astype(q_BxHxD.dtype)


def _decode_step(
    carry,
    q_BxKxGxD,
    k_pages,
    v_pages,
    tables_BxC,
    first_pos,
    lengths_B,
    scale,
    round_probs_dtype=None,
):
    """One online-softmax step over the C pages in tables_BxC (positions first_pos onwards)."""
    max_BxKxG, denom_BxKxG, acc_BxKxGxD = carry
    k_BxCxKxSxD = _gather_pages(k_pages, tables_BxC)
    v_BxCxKxSxD = _gather_pages(v_pages, tables_BxC)
    batch, pages, _, page_size, _ = k_BxCxKxSxD.shape
    pos_CxS = first_pos + jnp.arange(pages * page_size).reshape(pages, page_size)
    valid_BxCxS = pos_CxS[None] < lengths_B[:, None, None]
    # Zero unused V rows so masked probabilities (exact zeros) never meet a NaN.
    v_BxCxKxSxD = jnp.where(valid_BxCxS[:, :, None, :, None], v_BxCxKxSxD, 0)
    valid_Bx1x1xCxS = valid_BxCxS[:, None, None]
    # f32 operands: exact for bf16/f16 inputs, and XLA's CPU f32 dots beat its 16-bit ones
    # (the convert fuses into the gather).
    s_BxKxGxCxS = jnp.einsum(
        "bkgd,bcksd->bkgcs",
        q_BxKxGxD.astype(jnp.float32),
        k_BxCxKxSxD.astype(jnp.float32),
        preferred_element_type=jnp.float32,
    ) * jnp.float32(scale)
    s_BxKxGxCxS = jnp.where(valid_Bx1x1xCxS, s_BxKxGxCxS, -jnp.inf)
    new_max_BxKxG = jnp.maximum(max_BxKxG, jnp.max(s_BxKxGxCxS, axis=(-2, -1)))
    # While nothing is valid yet the max is -inf; shift by 0 instead (every term is masked).
    shift_BxKxG = jnp.where(jnp.isfinite(new_max_BxKxG), new_max_BxKxG, 0.0)
    alpha_BxKxG = jnp.exp(max_BxKxG - shift_BxKxG)  # exp(-inf) = 0 on the first valid step
    p_BxKxGxCxS = jnp.where(
        valid_Bx1x1xCxS, jnp.exp(s_BxKxGxCxS - shift_BxKxG[..., None, None]), 0.0
    )
    denom_BxKxG = denom_BxKxG * alpha_BxKxG + jnp.sum(p_BxKxGxCxS, axis=(-2, -1))
    # Probabilities stay f32 (the oracle should not round them) unless asked to reproduce the
    # kernel's 16-bit rounding; V is promoted.
    if round_probs_dtype is not None:
        p_BxKxGxCxS = p_BxKxGxCxS.astype(round_probs_dtype).astype(jnp.float32)
    pv_BxKxGxD = jnp.einsum(
        "bkgcs,bcksd->bkgd",
        p_BxKxGxCxS,
        v_BxCxKxSxD.astype(jnp.float32),
        preferred_element_type=jnp.float32,
    )
    acc_BxKxGxD = acc_BxKxGxD * alpha_BxKxG[..., None] + pv_BxKxGxD
    return new_max_BxKxG, denom_BxKxG, acc_BxKxGxD


@jax.named_call
def paged_prefill_attention_ref(
    q_BxTxHxD, k_pages_PxKxSxD, v_pages_PxKxSxD, block_tables_BxM, q_positions_BxT, *, scale
):
    """Causal chunked prefill: the query at absolute position p sees cached positions 0..p.

    The chunk's own K/V must already be written into the pages. Padding queries carry position
    -1 and get zeros. Returns [B, T, H, D] in q's dtype.
    """
    if q_BxTxHxD.ndim != 4:
        raise PagedAttentionShapeError(
            f"paged_prefill_attention: q {tuple(q_BxTxHxD.shape)} must be [batch, tokens, heads, "
            "head_dim]"
        )
    if q_positions_BxT.shape != q_BxTxHxD.shape[:2]:
        raise PagedAttentionShapeError(
            f"paged_prefill_attention: q_positions {tuple(q_positions_BxT.shape)} must be "
            f"[batch, tokens]={tuple(q_BxTxHxD.shape[:2])}"
        )
    kv_heads, group, page_size, head_dim = check_paged_inputs(
        q_BxTxHxD.shape,
        k_pages_PxKxSxD,
        v_pages_PxKxSxD,
        block_tables_BxM,
        where="paged_prefill_attention",
    )
    batch, tokens = q_BxTxHxD.shape[:2]
    pages = block_tables_BxM.shape[1]

    k_BxMxKxSxD = _gather_pages(k_pages_PxKxSxD, block_tables_BxM)
    v_BxMxKxSxD = _gather_pages(v_pages_PxKxSxD, block_tables_BxM)
    pos_MxS = jnp.arange(pages * page_size).reshape(pages, page_size)
    valid_BxTxMxS = pos_MxS[None, None] <= q_positions_BxT[:, :, None, None]
    # Every position any query of the sequence may see is <= its largest query position.
    last_B = jnp.max(q_positions_BxT, axis=1)
    seen_BxMxS = pos_MxS[None] <= last_B[:, None, None]
    v_BxMxKxSxD = jnp.where(seen_BxMxS[:, :, None, :, None], v_BxMxKxSxD, 0)

    q_BxTxKxGxD = q_BxTxHxD.reshape(batch, tokens, kv_heads, group, head_dim)
    s_BxKxGxTxMxS = jnp.einsum(
        "btkgd,bmksd->bkgtms", q_BxTxKxGxD, k_BxMxKxSxD, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    # jnp.where (not multiplication) keeps NaN scores of garbage slots out of max, exp and sum.
    valid_Bx1x1xTxMxS = valid_BxTxMxS[:, None, None]
    s_BxKxGxTxMxS = jnp.where(valid_Bx1x1xTxMxS, s_BxKxGxTxMxS, -jnp.inf)
    max_BxKxGxTx1x1 = jnp.max(s_BxKxGxTxMxS, axis=(-2, -1), keepdims=True)
    max_BxKxGxTx1x1 = jnp.where(jnp.isfinite(max_BxKxGxTx1x1), max_BxKxGxTx1x1, 0.0)
    p_BxKxGxTxMxS = jnp.where(valid_Bx1x1xTxMxS, jnp.exp(s_BxKxGxTxMxS - max_BxKxGxTx1x1), 0.0)
    denom_BxTxKxGx1 = jnp.moveaxis(jnp.sum(p_BxKxGxTxMxS, axis=(-2, -1)), 3, 1)[..., None]
    out_BxTxKxGxD = jnp.einsum(
        "bkgtms,bmksd->btkgd",
        p_BxKxGxTxMxS,
        v_BxMxKxSxD.astype(jnp.float32),
        preferred_element_type=jnp.float32,
    )
    # Padding queries (nothing valid) have a zero denominator and give zeros.
    out_BxTxKxGxD = jnp.where(
        denom_BxTxKxGx1 > 0,
        out_BxTxKxGxD / jnp.where(denom_BxTxKxGx1 > 0, denom_BxTxKxGx1, 1.0),
        0.0,
    )
    return out_BxTxKxGxD.reshape(batch, tokens, kv_heads * group, head_dim).astype(q_BxTxHxD.dtype)
