"""Token sampling from f32 logits: greedy, temperature, top-k, top-p, and behaviour logprobs.

Dimension letters (pipelinerl_jax/__init__.py): B rows (slots), V vocabulary, C vocabulary
chunks (blocks) of Vc = `_BLOCK` entries.

Behaviour logprob (what the trainer divides by in its importance ratio). The trainer computes
log_softmax(logits / T) over the full vocabulary, so by default the sampler records exactly
that for the sampled token ("tempered"): on-policy, the ratio is then exactly 1 whatever
top-k/top-p were. With `truncated=True` it records the log-probability under the truncated,
renormalised distribution the token was actually drawn from (differs only when top-k/top-p
cut something). Greedy rows (temperature 0) record log_softmax(logits) at the argmax, i.e. the
T = 1 distribution (what transformers' scores give for greedy decoding). Always f32.

CPU cost notes (why no sort and no cumsum over V): on XLA:CPU sorting [64, 32000] takes ~0.6 s
and a cumsum over V tens of ms, more than a whole decode step. So:
  * everything reduces over axis 0 of the vocabulary-major [V, B] logits the engine's LM head
    makes (`sample_vocab_major`); the row-major [B, V] functions (`sample`, `categorical`,
    `filter_top_k_top_p`) transpose and call them;
  * argmax is max + first-index-of-max (two plain reductions);
  * categorical sampling is a two-level inverse CDF: cumsum over C = V/128 block sums, then
    over the 128 entries of the chosen block, with one uniform per row;
  * top-k / top-p thresholds come from a 32-step bisection over the float bit patterns (exact,
    no sort) and only run when some row asks for them (`lax.cond`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_BLOCK = 128
# A numpy scalar, not a jnp array: importing the module must not start the XLA backend
# (jax.distributed.initialize has to come first in a multi-process run).
_UINT_SIGN = np.uint32(0x80000000)


def first_argmax(x_BxV, max_Bx1=None, *, axis: int = -1):
    """Index of the first maximum along `axis` (ties -> lowest index, as torch/numpy argmax).

    max_Bx1: the maxima (keepdims) when the caller has them already (saves a pass over V).
    axis=0 takes vocabulary-major [V, B] logits."""
    vocab = x_BxV.shape[axis]
    if max_Bx1 is None:
        max_Bx1 = jnp.max(x_BxV, axis=axis, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x_BxV.shape, axis % x_BxV.ndim)
    return jnp.min(jnp.where(x_BxV == max_Bx1, iota, vocab), axis=axis).astype(jnp.int32)


def log_softmax_at(x_BxV, tokens_B, max_Bx1=None, *, axis: int = -1):
    """log_softmax(x)[token] per row in f32, without materialising the full log_softmax.

    max_Bx1: the maxima of x along `axis` (keepdims) when the caller has them already.
    axis=0 takes vocabulary-major [V, B] logits."""
    x_BxV = x_BxV.astype(jnp.float32)
    if max_Bx1 is None:
        max_Bx1 = jnp.max(x_BxV, axis=axis, keepdims=True)
    max_Bx1 = jnp.where(jnp.isfinite(max_Bx1), max_Bx1, 0.0)
    lse_B = jnp.log(jnp.sum(jnp.exp(x_BxV - max_Bx1), axis=axis)) + jnp.squeeze(max_Bx1, axis)
    picked_B = jnp.squeeze(
        jnp.take_along_axis(x_BxV, jnp.expand_dims(tokens_B, axis), axis=axis), axis
    )
    return picked_B - lse_B


def _ordered_key(x):
    """f32 -> uint32 whose unsigned order is the float order (-inf lowest, +inf highest)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >= _UINT_SIGN, ~bits, bits | _UINT_SIGN)


def _top_k_key_threshold(keys_VxB, k_B):
    """Largest t with count(keys >= t) >= k, per column: the key of the k-th largest entry."""
    lo_B = jnp.zeros(k_B.shape, jnp.uint32)
    hi_B = jnp.full(k_B.shape, 0xFFFFFFFF, jnp.uint32)

    def step(_, carry):
        lo, hi = carry
        span = hi - lo
        mid = lo + span // 2 + (span & 1)  # ceil midpoint without uint32 overflow
        ok = jnp.sum(keys_VxB >= mid[None, :], axis=0) >= k_B
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo_B, _ = jax.lax.fori_loop(0, 32, step, (lo_B, hi_B))
    return lo_B


def _top_p_prob_threshold(probs_VxB, top_p_B):
    """Smallest t with (mass of probs strictly above t) < top_p, as a uint32 float pattern.

    Keeping probs >= t keeps exactly the tokens whose strictly-more-likely mass is below top_p:
    the nucleus of the sorted definition, ties at the boundary kept together.
    """
    bits_VxB = jax.lax.bitcast_convert_type(probs_VxB, jnp.uint32)  # probs >= 0: monotone
    lo_B = jnp.zeros(top_p_B.shape, jnp.uint32)
    hi_B = jnp.max(bits_VxB, axis=0)

    def step(_, carry):
        lo, hi = carry
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(bits_VxB > mid[None, :], probs_VxB, 0.0), axis=0)
        ok = above < top_p_B
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    _, hi_B = jax.lax.fori_loop(0, 32, step, (lo_B, hi_B))
    return hi_B


def filter_key_threshold(scaled_VxB, top_k_B, top_p_B):
    """Per column, the smallest `_ordered_key` that top-k, then top-p, keep (uint32 [B]).

    Keeping the entries whose key is >= it is exactly the sort-based filter: top-k keeps the
    keys >= the k-th largest (ties with it included); the top-p nucleus of the renormalised
    top-k distribution is {probs >= t}, and since probs are a monotone function of the logits
    that set is every key >= the smallest kept one. Returned as a threshold, not as masked
    logits, so a `lax.cond` around this returns [B] values instead of a copy of [V, B].
    top_k_B: int, 0 = off. top_p_B: f32 in (0, 1], 1 = off. Each bisection (32 passes over
    the logits) runs only when some column asks for it.
    """
    vocab = scaled_VxB.shape[0]
    keys_VxB = _ordered_key(scaled_VxB)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
    kth_B = jax.lax.cond(
        jnp.any(k_B < vocab),
        _top_k_key_threshold,
        lambda keys, k: jnp.zeros(k.shape, jnp.uint32),
        keys_VxB,
        k_B,
    )

    def nucleus(scaled_VxB, keys_VxB, kth_B):
        in_top_k_VxB = keys_VxB >= kth_B[None, :]
        probs_VxB = jax.nn.softmax(jnp.where(in_top_k_VxB, scaled_VxB, -jnp.inf), axis=0)
        t_B = _top_p_prob_threshold(probs_VxB, top_p_B)
        kept_VxB = in_top_k_VxB & (
            jax.lax.bitcast_convert_type(probs_VxB, jnp.uint32) >= t_B[None, :]
        )
        smallest_B = jnp.min(jnp.where(kept_VxB, keys_VxB, jnp.uint32(0xFFFFFFFF)), axis=0)
        return jnp.where(top_p_B < 1.0, smallest_B, kth_B)

    return jax.lax.cond(
        jnp.any(top_p_B < 1.0), nucleus, lambda s, k, kth: kth, scaled_VxB, keys_VxB, kth_B
    )


def filter_top_k_top_p(scaled_BxV, top_k_B, top_p_B):
    """Sets entries outside the top-k, then outside the top-p nucleus, to -inf (row-major
    [B, V]; `filter_key_threshold` says how). Top-p applies to the distribution renormalised
    over the top-k set (the order transformers and vLLM use)."""
    threshold_B = filter_key_threshold(scaled_BxV.T, top_k_B, top_p_B)
    return jnp.where(_ordered_key(scaled_BxV) >= threshold_B[:, None], scaled_BxV, -jnp.inf)


def categorical_vocab_major(masked_VxB, u_B):
    """Inverse-CDF sample from softmax over each column of [V, B], one uniform u in [0, 1) per
    column. A token with zero probability (-inf) is never returned."""
    return _inverse_cdf(masked_VxB, u_B)[0]


def _inverse_cdf(masked_VxB, u_B):
    """(tokens_B, max_B, total_B): `categorical_vocab_major`'s draw, and the column maxima and
    sums of exp(x - max) it computed on the way (log-sum-exp = max + log(total)).

    Two levels (block sums, then inside the chosen block) keep every cumsum short.
    """
    vocab, batch = masked_VxB.shape
    blocks = -(-vocab // _BLOCK)
    max_1xB = jnp.max(masked_VxB, axis=0, keepdims=True)
    probs_VxB = jnp.exp(masked_VxB - max_1xB)
    probs_CxVcxB = jnp.pad(probs_VxB, ((0, blocks * _BLOCK - vocab), (0, 0))).reshape(
        blocks, _BLOCK, batch
    )
    block_mass_CxB = jnp.sum(probs_CxVcxB, axis=1)
    block_cdf_CxB = jnp.cumsum(block_mass_CxB, axis=0)
    total_B = block_cdf_CxB[-1]
    target_B = jnp.minimum(u_B * total_B, jnp.nextafter(total_B, 0.0))
    # First block whose cumulative mass exceeds the target: it has positive mass.
    block_B = jnp.minimum(jnp.sum(block_cdf_CxB <= target_B[None, :], axis=0), blocks - 1)
    before_B = (
        jnp.take_along_axis(block_cdf_CxB, block_B[None, :], axis=0)[0]
        - jnp.take_along_axis(block_mass_CxB, block_B[None, :], axis=0)[0]
    )
    col_VcxB = jnp.take_along_axis(probs_CxVcxB, block_B[None, None, :], axis=0)[0]
    col_cdf_VcxB = jnp.cumsum(col_VcxB, axis=0)
    inner_B = jnp.sum(col_cdf_VcxB <= (target_B - before_B)[None, :], axis=0)
    # Rounding between the two cumsums may overshoot: fall back to the block's last positive.
    iota_Cx1 = jnp.arange(_BLOCK)[:, None]
    last_pos_B = jnp.max(jnp.where(col_VcxB > 0, iota_Cx1, 0), axis=0)
    inner_B = jnp.minimum(inner_B, last_pos_B)
    tokens_B = (block_B * _BLOCK + inner_B).astype(jnp.int32)
    return tokens_B, max_1xB[0], total_B


def categorical(masked_BxV, u_B):
    """`categorical_vocab_major` for row-major [B, V] logits."""
    return categorical_vocab_major(masked_BxV.T, u_B)


def sample(logits_BxV, temperature_B, top_k_B, top_p_B, u_B, *, truncated: bool = False):
    """Returns (tokens_B int32, behaviour logprobs_B f32); see the module docstring.

    temperature_B <= 0 means greedy for that row. u_B: uniforms in [0, 1), one per row.
    """
    return sample_vocab_major(
        logits_BxV.T, temperature_B, top_k_B, top_p_B, u_B, truncated=truncated
    )


def sample_vocab_major(
    logits_VxB, temperature_B, top_k_B, top_p_B, u_B, *, truncated: bool = False
):
    """`sample` on vocabulary-major [V, B] logits, as the engine's LM head makes them.

    Everything reduces over axis 0 of [V, B]: a transpose of the logits to [B, V] and the
    [B, V] copies in and out of `lax.cond`s cost more than the sampling itself
    (docs/cpu_measurements.md#vocabulary-major-sampling). Greedy rows and sampled rows each run inside a `lax.cond` that only runs when some
    row needs it and returns [B] results, so an all-greedy batch (evaluation) skips the
    sampler's passes and an all-sampled one (RL) skips the greedy ones.
    """
    logits_VxB = logits_VxB.astype(jnp.float32)
    greedy_B = temperature_B <= 0
    batch = greedy_B.shape[0]
    nothing = lambda *_: (jnp.zeros(batch, jnp.int32), jnp.zeros(batch, jnp.float32))

    def sampled(logits_VxB, u_B):
        temp_B = jnp.where(greedy_B, 1.0, temperature_B).astype(jnp.float32)
        needs_filter = jnp.any(~greedy_B & ((top_k_B > 0) | (top_p_B < 1.0)))
        return jax.lax.cond(
            needs_filter,
            functools.partial(draw, filtered=True),
            functools.partial(draw, filtered=False),
            logits_VxB,
            temp_B,
            u_B,
        )

    def draw(logits_VxB, temp_B, u_B, *, filtered: bool):
        scaled_VxB = masked_VxB = logits_VxB / temp_B[None, :]
        if filtered:
            threshold_B = filter_key_threshold(scaled_VxB, top_k_B, top_p_B)
            masked_VxB = jnp.where(
                _ordered_key(scaled_VxB) >= threshold_B[None, :], scaled_VxB, -jnp.inf
            )
        tokens_B, max_B, total_B = _inverse_cdf(masked_VxB, u_B)
        if filtered and not truncated:
            # The kept set holds the maximum, so the draw's max is the unfiltered one too.
            return tokens_B, log_softmax_at(scaled_VxB, tokens_B, max_B[None, :], axis=0)
        # The draw's own max and exp-sum: the logprob of the distribution drawn from, with
        # no further pass over [V, B].
        return tokens_B, _picked(scaled_VxB, tokens_B) - max_B - jnp.log(total_B)

    greedy_tokens_B, greedy_logprobs_B = jax.lax.cond(
        jnp.any(greedy_B),
        lambda logits_VxB, _: _greedy_vocab_major(logits_VxB),
        nothing,
        logits_VxB,
        u_B,
    )
    tokens_B, logprobs_B = jax.lax.cond(jnp.any(~greedy_B), sampled, nothing, logits_VxB, u_B)
    return (
        jnp.where(greedy_B, greedy_tokens_B, tokens_B),
        jnp.where(greedy_B, greedy_logprobs_B, logprobs_B),
    )


def _picked(x_VxB, tokens_B):
    """x[tokens_B[b], b] per column."""
    return jnp.take_along_axis(x_VxB, tokens_B[None, :], axis=0)[0]


def _greedy_vocab_major(logits_VxB):
    """(argmax, log_softmax at it) per column of [V, B] f32 logits: the T = 1 distribution.

    One row (B = 1) is reduced as the free [1, V] view: XLA:CPU runs a column reduction over
    [V, 1] as a scalar loop. From B = 2 on the column reductions vectorise over B and beat
    transposing (docs/cpu_measurements.md#greedy-reductions).
    """
    vocab, batch = logits_VxB.shape
    if batch == 1:
        row_1xV = logits_VxB.reshape(1, vocab)
        max_1x1 = jnp.max(row_1xV, axis=1, keepdims=True)
        tokens_B = first_argmax(row_1xV, max_1x1, axis=1)
        return tokens_B, log_softmax_at(row_1xV, tokens_B, max_1x1, axis=1)
    if vocab % _BLOCK:
        max_1xB = jnp.max(logits_VxB, axis=0, keepdims=True)
        tokens_B = first_argmax(logits_VxB, max_1xB, axis=0)
    else:
        max_1xB, tokens_B = _blocked_argmax(logits_VxB)
    return tokens_B, log_softmax_at(logits_VxB, tokens_B, max_1xB, axis=0)


def _blocked_argmax(logits_VxB):
    """(max [1, B], first argmax [B]) over [V, B] with V a multiple of `_BLOCK`, in one pass
    over the logits: block maxima [C, B], the first block holding the maximum, then the first
    maximum inside that block. `first_argmax` over the whole [V, B] materialises an int32
    [V, B] index array and reduces it again (docs/cpu_measurements.md#greedy-reductions)."""
    vocab, batch = logits_VxB.shape
    blocks_CxVcxB = logits_VxB.reshape(vocab // _BLOCK, _BLOCK, batch)
    block_max_CxB = jnp.max(blocks_CxVcxB, axis=1)
    max_1xB = jnp.max(block_max_CxB, axis=0, keepdims=True)
    block_B = first_argmax(block_max_CxB, max_1xB, axis=0)
    block_CxB = jnp.take_along_axis(blocks_CxVcxB, block_B[None, None, :], axis=0)[0]
    return max_1xB, block_B * _BLOCK + first_argmax(block_CxB, max_1xB, axis=0)
