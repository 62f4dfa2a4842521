"""Decode attention over a dense copy of each slot's window, made once per chunk (CPU path).

The kernels of the "staged" decode strategy (strategies.StagedAttention, the default off
NVIDIA GPUs): `stage` runs once per chunk, `decode_attend_staged` is each step's hook.

The page pool stays the one source of truth: every step still writes its K/V into the pages,
so prefill, preemption, shared prefixes and param swaps see exactly what the "paged" path
leaves behind. What changes is how attention reads the cache. Paged attention gathers each
row's pages every step and layer, and on CPU that gather is a full copy of the window
(XLA:CPU has no fused gather-matmul), a large part of a decode step
(docs/cpu_measurements.md#decode-attention-strategies). Here the window is gathered once at the start of the chunk into per-layer
dense arrays laid out for the two dots (K as [B, K, D, N], V as [B, K, N, D]), and each step
writes its token into them as well as into the pages; over a 16-step chunk the gather is paid
once instead of 16 times.

Cost: while a chunk runs, the window of every slot exists twice (pages + the dense copy):
2 * L * B * K * N * D * itemsize bytes (168 MB for the bench model at batch 64, N = 160).
The "paged" strategy avoids it (and is what runs on GPUs, where the Triton kernel reads the
pages directly).

Rows are garbage-safe as in the paged path: positions at or past a row's cached length are
zeroed when staged, scores past the query position are replaced by -inf, and rows that do not
write (inactive slots) write nothing.

Dimension letters (pipelinerl_jax/__init__.py):
B rows, H query heads, K kv heads, G = H / K, D head dim, L layers,
P pages per layer, S page size, W window pages, N = W * S staged positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipelinerl_jax.sampler.attend import f32_of, set_at, write_layer_kv


@jax.named_call
def stage(k_pages, v_pages, block_tables_BxW, cached_B):
    """Per-layer dense copies of the first W pages of each row, positions >= cached_B zeroed.

    k_pages, v_pages: [L, P, K, S, D]. Returns (k: L x [B, K, D, N], v: L x [B, K, N, D]).
    """
    num_layers, _, kv_heads, page_size, head_dim = k_pages.shape
    batch, window = block_tables_BxW.shape
    n = window * page_size
    valid_BxWxS = jnp.arange(n).reshape(window, page_size)[None] < cached_B[:, None, None]
    keep_Bx1xWxSx1 = valid_BxWxS[:, None, :, :, None]
    k_stage, v_stage = [], []
    for layer in range(num_layers):
        # mode="clip": an out-of-range id must never gather NaN fill (it is zeroed anyway).
        k_BxWxKxSxD = jnp.take(k_pages[layer], block_tables_BxW, axis=0, mode="clip")
        v_BxWxKxSxD = jnp.take(v_pages[layer], block_tables_BxW, axis=0, mode="clip")
        k_BxKxWxSxD = jnp.where(keep_Bx1xWxSx1, k_BxWxKxSxD.transpose(0, 2, 1, 3, 4), 0)
        v_BxKxWxSxD = jnp.where(keep_Bx1xWxSx1, v_BxWxKxSxD.transpose(0, 2, 1, 3, 4), 0)
        k_stage.append(k_BxKxWxSxD.transpose(0, 1, 4, 2, 3).reshape(batch, kv_heads, head_dim, n))
        v_stage.append(v_BxKxWxSxD.reshape(batch, kv_heads, n, head_dim))
    return tuple(k_stage), tuple(v_stage)


def decode_attend_staged(block_tables_BxM, positions_B, write_B, *, scale: float, cache_dtype=None):
    """attend() for one token per row over the staged window (and the token itself).

    Carry: (layer, (k_pages, v_pages, k_stage, v_stage)); the step's K/V is written into the
    pool and into this layer's staged arrays (rows with write False write to the null page
    and not at all into the stage), then attention reads positions <= positions_B.
    cache_dtype: given when the pool (and so its stage) holds 16-bit floats stored as their
    uint16 bits (`DecodeAttention.pool_dtype`; `attend.set_at` says why).
    """

    def attend(q_Bx1xHxD, k_Bx1xKxD, v_Bx1xKxD, layer_and_carry):
        layer, (k_pages, v_pages, k_stage, v_stage) = layer_and_carry
        at = (block_tables_BxM, positions_B[:, None], write_B[:, None])
        k_pages = write_layer_kv(k_pages, layer, k_Bx1xKxD, *at, scatter=set_at, dtype=cache_dtype)
        v_pages = write_layer_kv(v_pages, layer, v_Bx1xKxD, *at, scatter=set_at, dtype=cache_dtype)
        k_BxKxDxN, v_BxKxNxD = k_stage[layer], v_stage[layer]
        batch, kv_heads, head_dim, n = k_BxKxDxN.shape
        rows_B = jnp.arange(batch)
        # Out of range for rows that do not write: mode="drop" leaves their stage untouched.
        at_B = jnp.where(write_B, positions_B, n)
        k_BxKxDxN = set_at(
            k_BxKxDxN,
            (rows_B, slice(None), slice(None), at_B),
            k_Bx1xKxD[:, 0],
            dtype=cache_dtype,
            mode="drop",
        )
        v_BxKxNxD = set_at(
            v_BxKxNxD,
            (rows_B, slice(None), at_B, slice(None)),
            v_Bx1xKxD[:, 0],
            dtype=cache_dtype,
            mode="drop",
        )
        out_BxHxD = dense_decode_attention(
            q_Bx1xHxD[:, 0],
            f32_of(k_BxKxDxN, cache_dtype or k_BxKxDxN.dtype),
            f32_of(v_BxKxNxD, cache_dtype or v_BxKxNxD.dtype),
            positions_B,
            scale=scale,
        )
        k_stage = k_stage[:layer] + (k_BxKxDxN,) + k_stage[layer + 1 :]
        v_stage = v_stage[:layer] + (v_BxKxNxD,) + v_stage[layer + 1 :]
        return out_BxHxD[:, None], (layer, (k_pages, v_pages, k_stage, v_stage))

    return attend


@jax.named_call
def dense_decode_attention(q_BxHxD, k_BxKxDxN, v_BxKxNxD, positions_B, *, scale: float):
    """Each row's query attends to staged positions <= positions_B; f32 softmax, q's dtype."""
    batch, heads, head_dim = q_BxHxD.shape
    kv_heads, n = k_BxKxDxN.shape[1], k_BxKxDxN.shape[3]
    f32 = jnp.float32
    # Broadcast-multiply-reduce rather than einsum: with G = H / K query heads per kv head the
    # two products are batches of [G, D] @ [D, N] matmuls too small for YNNPACK; as loop
    # fusions they read each staged array once (docs/cpu_measurements.md#staged-attention-dots).
    q_BxKxGxDx1 = q_BxHxD.reshape(batch, kv_heads, heads // kv_heads, head_dim, 1).astype(f32)
    s_BxKxGxN = jnp.sum(q_BxKxGxDx1 * k_BxKxDxN.astype(f32)[:, :, None], axis=3) * f32(scale)
    valid_Bx1x1xN = (jnp.arange(n)[None, :] <= positions_B[:, None])[:, None, None]
    s_BxKxGxN = jnp.where(valid_Bx1x1xN, s_BxKxGxN, -jnp.inf)
    # Every row sees at least position 0 (its own token at position >= 0): the max is finite.
    p_BxKxGxN = jnp.exp(s_BxKxGxN - jnp.max(s_BxKxGxN, axis=-1, keepdims=True))
    out_BxKxGxD = jnp.sum(p_BxKxGxN[..., None] * v_BxKxNxD.astype(f32)[:, :, None], axis=3)
    out_BxKxGxD = out_BxKxGxD / jnp.sum(p_BxKxGxN, axis=-1)[..., None]
    return out_BxKxGxD.reshape(batch, heads, head_dim).astype(q_BxHxD.dtype)
