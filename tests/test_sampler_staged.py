"""The staged decode path (sampler/staged.py) against the paged-attention oracle.

Random pools in the sampler's layout with NaN in the null page, in spare pages and in every
slot past a row's cached length; several decode steps in a row, with a row that stops writing
half-way (an inactive slot), each step checked against `paged_decode_attention_ref` over the
pool as written so far.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.kernels.paged_attention_ref import paged_decode_attention_ref
from pipelinerl_jax.sampler import staged

L, P, K, S, D, H = 2, 30, 2, 8, 16, 6  # GQA group of 3
SCALE = 0.3


def _case(rng, cached, width):
    """Pool [L, P, K, S, D], tables [B, width]; NaN wherever nothing valid was written."""
    k = rng.normal(size=(L, P, K, S, D)).astype(np.float32)
    v = rng.normal(size=(L, P, K, S, D)).astype(np.float32)
    batch = len(cached)
    tables = rng.permutation(np.arange(1, P))[: batch * width].reshape(batch, width)
    k[:, 0] = v[:, 0] = np.nan  # the null page holds garbage
    for b, n in enumerate(cached):
        for pos in range(n, width * S):
            k[:, tables[b, pos // S], :, pos % S] = np.nan
            v[:, tables[b, pos // S], :, pos % S] = np.nan
    return k, v, tables.astype(np.int32)


def test_stage_copies_the_window_and_zeroes_the_rest():
    rng = np.random.default_rng(0)
    cached = np.array([0, 5, 8, 23], np.int32)
    k, v, tables = _case(rng, cached, width=3)
    k_stage, v_stage = jax.jit(staged.stage)(k, v, tables, cached)
    assert len(k_stage) == len(v_stage) == L
    for layer in range(L):
        ks, vs = np.asarray(k_stage[layer]), np.asarray(v_stage[layer])
        assert ks.shape == (4, K, D, 3 * S) and vs.shape == (4, K, 3 * S, D)
        for b, n_cached in enumerate(cached):
            for pos in range(3 * S):
                page, slot = tables[b, pos // S], pos % S
                want_k = k[layer, page, :, slot] if pos < n_cached else np.zeros((K, D))
                want_v = v[layer, page, :, slot] if pos < n_cached else np.zeros((K, D))
                np.testing.assert_array_equal(ks[b, :, :, pos], want_k)
                np.testing.assert_array_equal(vs[b, :, pos], want_v)


def test_staged_steps_match_the_paged_oracle():
    rng = np.random.default_rng(1)
    width, steps = 4, 3
    cached = np.array([0, 7, 15, 26], np.int32)  # first token, page edges, near the end
    k, v, tables = _case(rng, cached, width)
    batch = len(cached)
    q = rng.normal(size=(steps, batch, 1, H, D)).astype(np.float32)
    k_new = rng.normal(size=(steps, batch, 1, K, D)).astype(np.float32)
    v_new = rng.normal(size=(steps, batch, 1, K, D)).astype(np.float32)
    # Row 3 is active for the first step only (its sequence finished).
    write = np.ones((steps, batch), bool)
    write[1:, 3] = False

    @jax.jit
    def run(k_pool, v_pool):
        stage = staged.stage(k_pool, v_pool, tables, jnp.asarray(cached))
        outs, wants = [], []
        for t in range(steps):
            # An inactive row's length (hence position) stops advancing.
            positions = jnp.asarray(cached + np.where(write[t], t, min(t, 1)))
            attend = staged.decode_attend_staged(
                tables, positions, jnp.asarray(write[t]), scale=SCALE
            )
            carry = (k_pool, v_pool, *stage)
            for layer in range(L):
                out, (_, carry) = attend(q[t], k_new[t], v_new[t], (layer, carry))
                k_pool, v_pool = carry[:2]
                want = paged_decode_attention_ref(
                    q[t][:, 0], k_pool[layer], v_pool[layer], tables, positions + 1, scale=SCALE
                )
                outs.append(out[:, 0])
                wants.append(want)
            stage = tuple(carry[2:])
        return jnp.stack(outs), jnp.stack(wants), k_pool, stage

    outs, wants, k_pool, (k_stage, _) = run(k, v)
    # Row 3 stopped writing: its later outputs are not used (and the oracle would read the
    # pool it no longer writes); every other step of every row must match.
    outs, wants = np.asarray(outs), np.asarray(wants)
    assert np.isfinite(outs[:, :3]).all()
    np.testing.assert_allclose(outs[:, :3], wants[:, :3], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(outs[:L, 3], wants[:L, 3], rtol=2e-5, atol=2e-5)
    # The pool holds every written token, so later chunks (and the paged path) see them.
    for t in range(steps):
        for b in range(batch):
            if write[t, b]:
                pos = cached[b] + t
                page = tables[b, pos // S]
                np.testing.assert_array_equal(
                    np.asarray(k_pool)[:, page, :, pos % S],
                    np.broadcast_to(k_new[t, b, 0], (L, K, D)),
                )
    # The inactive steps of row 3 left its stage alone: only position cached + 0 was written.
    k3 = np.asarray(k_stage[0])[3]
    np.testing.assert_array_equal(k3[:, :, cached[3]], k_new[0, 3, 0])
    assert not k3[:, :, cached[3] + 1 :].any()


def test_dense_attention_rows_see_only_their_positions():
    """A NaN staged past a row's position never reaches its output."""
    rng = np.random.default_rng(2)
    batch, n = 3, 12
    q = jnp.asarray(rng.normal(size=(batch, H, D)), jnp.float32)
    k = rng.normal(size=(batch, K, D, n)).astype(np.float32)
    v = rng.normal(size=(batch, K, n, D)).astype(np.float32)
    positions = np.array([0, 5, 11], np.int32)
    out = staged.dense_decode_attention(
        q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions), scale=SCALE
    )
    k[0, :, :, 1:] = np.nan  # garbage past row 0's position
    out_nan = staged.dense_decode_attention(
        q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions), scale=SCALE
    )
    assert np.isfinite(np.asarray(out_nan)).all()
    np.testing.assert_array_equal(np.asarray(out_nan), np.asarray(out))
    # Row 1 by hand: softmax over its first 6 positions.
    qg = np.asarray(q)[1].reshape(K, H // K, D)
    s = np.einsum("kgd,kdn->kgn", qg, k[1, :, :, :6]) * SCALE
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("kgn,knd->kgd", p / p.sum(-1, keepdims=True), v[1, :, :6]).reshape(H, D)
    np.testing.assert_allclose(np.asarray(out)[1], want, rtol=2e-5, atol=2e-5)


def test_f32_of_widens_every_bf16_bit_pattern_exactly():
    """attend.f32_of on a stage carried as bits equals the float view widened to f32 for all
    65536 bf16 patterns (NaNs compared as NaN), and for fp16 and f32 arrays as they are."""
    from pipelinerl_jax.sampler import attend

    bits = jnp.arange(2**16, dtype=jnp.uint32).astype(jnp.uint16)
    for dtype in (jnp.bfloat16, jnp.float16):
        got = np.asarray(jax.jit(attend.f32_of, static_argnums=1)(bits, dtype))
        want = np.asarray(jax.lax.bitcast_convert_type(bits, dtype).astype(jnp.float32))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        np.testing.assert_array_equal(got[ok], want[ok])
    x = jnp.asarray(np.random.default_rng(0).standard_normal(7), jnp.float32)
    np.testing.assert_array_equal(attend.f32_of(x, jnp.float32), x)
