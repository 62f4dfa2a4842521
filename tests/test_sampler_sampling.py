"""Sampling: greedy, top-k/top-p thresholds against a sort-based numpy reference, inverse-CDF
draws against searchsorted, sampled frequencies against the softmax (chi-square), top-1 ==
greedy, and the behaviour-logprob conventions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.sampler import sampling

sample = jax.jit(sampling.sample, static_argnames=("truncated",))


def _np_filter(x, k, p):
    """Sort-based reference: top-k, then the nucleus of the renormalised top-k distribution."""
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(x.shape, bool)
    keep[order[: k if k > 0 else len(x)]] = True
    kth = x[order[(k if k > 0 else len(x)) - 1]]
    keep |= x >= kth  # ties with the k-th are kept
    if p < 1:
        q = np.where(keep, np.exp(x - x.max()), 0.0)
        q /= q.sum()
        above = np.array([q[q > qi].sum() for qi in q])  # mass strictly more likely
        keep &= above < p
    return keep


def test_filter_matches_sort_reference():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(8, 300)) * 3).astype(np.float32)
    x[1, :10] = x[1, 0]  # ties at the top
    x[2] = np.round(x[2])  # many ties everywhere
    k = np.array([0, 1, 5, 17, 300, 3, 0, 40], np.int32)
    p = np.array([1, 1, 1, 0.9, 0.5, 0.3, 0.95, 0.05], np.float32)
    got = np.isfinite(np.asarray(jax.jit(sampling.filter_top_k_top_p)(x, k, p)))
    for i in range(len(x)):
        np.testing.assert_array_equal(got[i], _np_filter(x[i], k[i], p[i]), err_msg=f"row {i}")


def test_categorical_is_the_inverse_cdf():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 1000)).astype(np.float32)
    x[3, 500:] = -np.inf  # masked tail never drawn
    u = rng.uniform(size=16).astype(np.float32)
    u[0], u[1] = 0.0, np.float32(1 - 2**-24)  # the extremes
    got = np.asarray(jax.jit(sampling.categorical)(x, u))
    for i in range(16):
        q = np.exp(x[i] - x[i].max())
        cdf = np.cumsum(q.astype(np.float64)) / q.sum()
        want = min(np.searchsorted(cdf, u[i], side="right"), np.flatnonzero(q)[-1])
        # f32 two-level cumsum vs f64: allow the neighbour only when u sits on a boundary.
        assert got[i] == want or abs(cdf[min(got[i], want)] - u[i]) < 1e-5, i
        assert np.isfinite(x[i, got[i]])


def test_frequencies_match_the_sampled_distribution_chi_square():
    """One call, two halves: plain temperature, and temperature + top-k + top-p.

    Rows without truncation record the same logprob either way, so truncated=True checks both
    conventions: log_softmax(logits / T) for the first half, the renormalised truncated
    distribution for the second.
    """
    logits = np.array([1.0, 0.5, -0.3, 2.0, 0.0, -1.0], np.float32)
    half = 12000
    u = jax.random.uniform(jax.random.key(1234), (2 * half,))
    temperature = np.r_[np.full(half, 0.7), np.full(half, 1.0)].astype(np.float32)
    top_k = np.r_[np.zeros(half), np.full(half, 4)].astype(np.int32)
    top_p = np.r_[np.ones(half), np.full(half, 0.8)].astype(np.float32)
    tokens, logprobs = sample(
        jnp.tile(logits, (2 * half, 1)), temperature, top_k, top_p, u, truncated=True
    )
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    assert logprobs.dtype == np.float32
    plain = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    keep = _np_filter(logits, 4, 0.8)
    trunc = np.where(keep, np.exp(logits), 0.0)
    trunc /= trunc.sum()
    # 99.9% chi-square quantiles: 20.5 for 5 dof, 16.3 for <= 3 dof.
    for rows, probs, bound in ((slice(0, half), plain, 20.5), (slice(half, None), trunc, 16.3)):
        counts = np.bincount(tokens[rows], minlength=len(logits))
        assert counts[probs == 0].sum() == 0
        nz = probs > 0
        chi2 = ((counts[nz] - half * probs[nz]) ** 2 / (half * probs[nz])).sum()
        assert chi2 < bound, (chi2, counts)
        log_p = np.log(np.where(nz, probs, 1.0))
        np.testing.assert_allclose(logprobs[rows], log_p[tokens[rows]], rtol=1e-5)


def test_top1_equals_greedy_and_rows_are_independent():
    """Rows 0-31: top-k=1 sampling; 32-63: greedy; 64-95: greedy next to sampling rows."""
    rng = np.random.default_rng(3)
    x = np.asarray(rng.normal(size=(96, 500)).astype(np.float32) * 4)
    u = jax.random.uniform(jax.random.key(0), (96,))
    temperature = np.r_[np.full(32, 1.3), np.zeros(32), np.tile([0.0, 0.5], 16)]
    top_k = np.r_[np.ones(32), np.zeros(32), np.tile([0, 5], 16)].astype(np.int32)
    top_p = np.r_[np.ones(64), np.tile([1.0, 0.5], 16)].astype(np.float32)
    tokens, lp = sample(jnp.asarray(x), jnp.asarray(temperature, jnp.float32), top_k, top_p, u)
    tokens, lp = np.asarray(tokens), np.asarray(lp)
    greedy = np.argmax(x, -1)
    np.testing.assert_array_equal(tokens[:64], greedy[:64])
    np.testing.assert_array_equal(tokens[64::2], greedy[64::2])
    for i in range(65, 96, 2):  # the sampling rows obey their filter
        assert _np_filter(x[i] / 0.5, 5, 0.5)[tokens[i]]
    # Greedy records the T = 1 log-probability of the argmax.
    want = np.asarray(jax.nn.log_softmax(x))[np.arange(32, 64), greedy[32:64]]
    np.testing.assert_allclose(lp[32:64], want, rtol=1e-6, atol=1e-6)


def test_first_argmax_breaks_ties_low_like_numpy():
    x = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-jnp.inf, -2.0, -2.0, -3.0]])
    np.testing.assert_array_equal(np.asarray(sampling.first_argmax(x)), [1, 0, 1])


def test_vocab_major_reductions_equal_row_major():
    """The engine samples from [V, B] logits: axis-0 argmax / log-softmax equal the [B, V] ones,
    ties and -inf included, and an all-greedy batch gives argmax with its T = 1 logprob."""
    x = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-jnp.inf, -2.0, -2.0, -3.0]])
    np.testing.assert_array_equal(np.asarray(sampling.first_argmax(x.T, axis=0)), [1, 0, 1])
    rng = np.random.default_rng(5)
    y = jnp.asarray(rng.normal(size=(7, 300)).astype(np.float32) * 3)
    tokens = jnp.asarray(rng.integers(0, 300, 7), jnp.int32)
    np.testing.assert_allclose(
        np.asarray(sampling.log_softmax_at(y.T, tokens, axis=0)),
        np.asarray(sampling.log_softmax_at(y, tokens)),
        rtol=1e-6,
    )
    zeros = jnp.zeros(7)
    got_t, got_lp = jax.jit(sampling.sample_vocab_major)(
        y.T, zeros, jnp.zeros(7, jnp.int32), jnp.ones(7), zeros + 0.5
    )
    np.testing.assert_array_equal(np.asarray(got_t), np.argmax(np.asarray(y), -1))
    want = np.asarray(jax.nn.log_softmax(y))[np.arange(7), np.asarray(got_t)]
    np.testing.assert_allclose(np.asarray(got_lp), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2])
def test_vocab_major_greedy_one_row(rows):
    """B = 1 takes the row view of [V, 1] (a different reduction than B >= 2): same argmax
    (first of tied maxima) and T = 1 logprob as numpy, also with -inf entries."""
    rng = np.random.default_rng(rows)
    y = rng.normal(size=(rows, 500)).astype(np.float32) * 4
    y[:, 7] = y[:, 300] = y.max() + 1.0  # tie: the lower index wins
    y[:, 11] = -np.inf
    ones = jnp.ones(rows)
    got_t, got_lp = jax.jit(sampling.sample_vocab_major)(
        jnp.asarray(y.T), ones * 0.0, jnp.zeros(rows, jnp.int32), ones, ones * 0.5
    )
    np.testing.assert_array_equal(np.asarray(got_t), [7] * rows)
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(y)))[:, 7]
    np.testing.assert_allclose(np.asarray(got_lp), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vocab", [128 * 5, 600])
def test_vocab_major_greedy_blocked_argmax_ties(vocab):
    """V a multiple of 128 takes the blocked argmax: the first maximum wins across blocks and
    inside one, also when the tie sits in a later block or at a block's first entry."""
    rng = np.random.default_rng(vocab)
    y = rng.normal(size=(6, vocab)).astype(np.float32)
    top = y.max() + 1.0
    y[0, [300, 129]] = top  # two blocks: the lower index wins
    y[1, [128, 255]] = top  # first entry of a block
    y[2, [vocab - 1]] = top  # last entry of the last block
    y[3, :] = -np.inf
    y[3, [17, 18]] = 0.0  # all but a tie are -inf
    zeros = jnp.zeros(6)
    got_t, got_lp = jax.jit(sampling.sample_vocab_major)(
        jnp.asarray(y.T), zeros, jnp.zeros(6, jnp.int32), zeros + 1.0, zeros + 0.5
    )
    np.testing.assert_array_equal(np.asarray(got_t), np.argmax(y, axis=-1))
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(y)))[np.arange(6), np.argmax(y, axis=-1)]
    np.testing.assert_allclose(np.asarray(got_lp), want, rtol=1e-6, atol=1e-6)


def test_unfiltered_batch_frequencies_and_tempered_logprobs():
    """No row filters: the draw's own max and exp-sum give the logprob (the `unfiltered`
    branch); it must equal log_softmax(logits / T), and frequencies the softmax."""
    logits = np.array([0.3, -1.2, 2.1, 0.0, 1.4], np.float32)
    n = 20000
    u = jax.random.uniform(jax.random.key(7), (n,))
    temperature = np.full(n, 1.3, np.float32)
    tokens, logprobs = sample(
        jnp.tile(logits, (n, 1)), temperature, np.zeros(n, np.int32), np.ones(n, np.float32), u
    )
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    probs = np.exp(logits / 1.3) / np.exp(logits / 1.3).sum()
    counts = np.bincount(tokens, minlength=len(logits))
    chi2 = ((counts - n * probs) ** 2 / (n * probs)).sum()
    assert chi2 < 18.5, (chi2, counts)  # 99.9% quantile, 4 dof
    np.testing.assert_allclose(logprobs, np.log(probs)[tokens], rtol=1e-5)


@pytest.mark.parametrize("truncated", [False, True])
def test_filtered_batch_logprob_conventions(truncated):
    """Rows that filter and rows that do not, in one batch (the `filtered` branch): by default
    every row records log_softmax(logits / T) at its token; truncated=True records the
    renormalised truncated distribution for the filtering rows."""
    rng = np.random.default_rng(11)
    x = (rng.normal(size=(6, 400)) * 2).astype(np.float32)
    temperature = np.array([0.8, 1.0, 1.5, 0.8, 1.0, 1.5], np.float32)
    top_k = np.array([0, 10, 0, 0, 3, 50], np.int32)
    top_p = np.array([1.0, 1.0, 0.7, 1.0, 0.9, 0.5], np.float32)
    u = jax.random.uniform(jax.random.key(3), (6,))
    tokens, lp = sample(jnp.asarray(x), temperature, top_k, top_p, u, truncated=truncated)
    tokens, lp = np.asarray(tokens), np.asarray(lp)
    scaled = x / temperature[:, None]
    for i in range(6):
        keep = _np_filter(scaled[i], top_k[i], top_p[i])
        assert keep[tokens[i]], i
        z = np.where(keep, scaled[i], -np.inf) if truncated else scaled[i]
        want = z[tokens[i]] - (z.max() + np.log(np.exp(z - z.max()).sum()))
        np.testing.assert_allclose(lp[i], want, rtol=1e-5, atol=1e-6, err_msg=f"row {i}")
