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
    keep[order[:k if k > 0 else len(x)]] = True
    kth = x[order[(k if k > 0 else len(x)) - 1]]
    keep |= x >= kth                                   # ties with the k-th are kept
    if p < 1:
        q = np.where(keep, np.exp(x - x.max()), 0.0)
        q /= q.sum()
        above = np.array([q[q > qi].sum() for qi in q])  # mass strictly more likely
        keep &= above < p
    return keep


def test_filter_matches_sort_reference():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(8, 300)) * 3).astype(np.float32)
    x[1, :10] = x[1, 0]                                # ties at the top
    x[2] = np.round(x[2])                              # many ties everywhere
    k = np.array([0, 1, 5, 17, 300, 3, 0, 40], np.int32)
    p = np.array([1, 1, 1, 0.9, 0.5, 0.3, 0.95, 0.05], np.float32)
    got = np.isfinite(np.asarray(jax.jit(sampling.filter_top_k_top_p)(x, k, p)))
    for i in range(len(x)):
        np.testing.assert_array_equal(got[i], _np_filter(x[i], k[i], p[i]), err_msg=f"row {i}")


def test_categorical_is_the_inverse_cdf():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 1000)).astype(np.float32)
    x[3, 500:] = -np.inf                               # masked tail never drawn
    u = rng.uniform(size=16).astype(np.float32)
    u[0], u[1] = 0.0, np.float32(1 - 2**-24)           # the extremes
    got = np.asarray(jax.jit(sampling.categorical)(x, u))
    for i in range(16):
        q = np.exp(x[i] - x[i].max())
        cdf = np.cumsum(q.astype(np.float64)) / q.sum()
        want = min(np.searchsorted(cdf, u[i], side="right"), np.flatnonzero(q)[-1])
        # f32 two-level cumsum vs f64: allow the neighbour only when u sits on a boundary.
        assert got[i] == want or abs(cdf[min(got[i], want)] - u[i]) < 1e-5, i
        assert np.isfinite(x[i, got[i]])


def test_sampled_frequencies_match_softmax_chi_square():
    vocab, draws, temperature = 6, 20000, 0.7
    logits = np.array([1.0, 0.5, -0.3, 2.0, 0.0, -1.0], np.float32)
    keys = jax.random.split(jax.random.key(1234), draws)
    u = jax.vmap(lambda k: jax.random.uniform(k))(keys)
    tokens, logprobs = sample(jnp.tile(logits, (draws, 1)), jnp.full(draws, temperature),
                              jnp.zeros(draws, jnp.int32), jnp.ones(draws), u)
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    probs = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
    chi2 = ((counts - draws * probs) ** 2 / (draws * probs)).sum()
    assert chi2 < 20.5, (chi2, counts)    # 99.9% quantile of chi-square with 5 dof
    # Behaviour logprob = log_softmax(logits / T) of the drawn token, f32.
    np.testing.assert_allclose(np.asarray(logprobs), np.log(probs)[np.asarray(tokens)],
                               rtol=1e-5)
    assert logprobs.dtype == jnp.float32


def test_top_k_top_p_frequencies_and_truncated_logprobs():
    logits = np.array([2.0, 1.5, 1.0, 0.0, -1.0, -2.0], np.float32)
    draws = 12000
    u = jax.random.uniform(jax.random.key(7), (draws,))
    row = lambda v, dt: jnp.full(draws, v, dt)
    tokens, lp_trunc = sample(jnp.tile(logits, (draws, 1)), row(1.0, jnp.float32),
                              row(4, jnp.int32), row(0.8, jnp.float32), u, truncated=True)
    keep = _np_filter(logits, 4, 0.8)
    q = np.where(keep, np.exp(logits), 0.0)
    q /= q.sum()
    counts = np.bincount(np.asarray(tokens), minlength=6)
    assert counts[~keep].sum() == 0
    nz = q > 0
    chi2 = ((counts[nz] - draws * q[nz]) ** 2 / (draws * q[nz])).sum()
    assert chi2 < 16.3, (chi2, counts)    # 99.9% quantile, <= 3 dof
    log_q = np.log(np.where(q > 0, q, 1.0))
    np.testing.assert_allclose(np.asarray(lp_trunc), log_q[np.asarray(tokens)], rtol=1e-5)


def test_top1_equals_greedy_and_greedy_logprob():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(32, 500)).astype(np.float32) * 4)
    u = jax.random.uniform(jax.random.key(0), (32,))
    ones, zeros = jnp.ones(32), jnp.zeros(32)
    top1, _ = sample(x, ones * 1.3, jnp.ones(32, jnp.int32), ones, u)
    greedy, lp = sample(x, zeros, jnp.zeros(32, jnp.int32), ones, u)
    np.testing.assert_array_equal(np.asarray(top1), np.argmax(np.asarray(x), -1))
    np.testing.assert_array_equal(np.asarray(greedy), np.argmax(np.asarray(x), -1))
    # Greedy records the T = 1 log-probability of the argmax.
    want = np.asarray(jax.nn.log_softmax(x))[np.arange(32), np.asarray(greedy)]
    np.testing.assert_allclose(np.asarray(lp), want, rtol=1e-6, atol=1e-6)


def test_first_argmax_breaks_ties_low_like_numpy():
    x = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-jnp.inf, -2.0, -2.0, -3.0]])
    np.testing.assert_array_equal(np.asarray(sampling.first_argmax(x)), [1, 0, 1])


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_mixed_batch_rows_are_independent(temperature):
    """A greedy row next to a sampling row with top-p is still exactly greedy."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(2, 64)).astype(np.float32))
    tokens, _ = sample(x, jnp.asarray([0.0, temperature]), jnp.asarray([0, 5], jnp.int32),
                       jnp.asarray([1.0, 0.5]), jnp.asarray([0.3, 0.3]))
    assert int(tokens[0]) == int(np.argmax(np.asarray(x[0])))
    assert _np_filter(np.asarray(x[1]) / temperature, 5, 0.5)[int(tokens[1])]
