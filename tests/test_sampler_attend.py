"""The sampler's attention hooks against the kernels' pure-jnp paged attention oracle.

`decode_attend` / `prefill_attend` attend over (pages before the current tokens) + (the current
tokens' own K/V, not yet in the pages), then write that K/V; the oracle attends over pages that
already contain it. So the test writes the new K/V into a copy of the pool with
`write_layer_kv` and compares outputs, and the hooks' carried pools with that copy.
`decode_attend_paged` writes first and calls the dispatcher itself. NaN planted in unused pool
rows checks that garbage never leaks into live outputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.kernels.paged_attention_ref import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from pipelinerl_jax.sampler import attend as attn

L, P, S, K, D, H = 2, 24, 8, 2, 16, 6  # GQA group of 3
SCALE = D**-0.5


def _pool(rng):
    """Random pools in the sampler's layout [L, P, K, S, D]."""
    k = rng.normal(size=(L, P, K, S, D)).astype(np.float32)
    v = rng.normal(size=(L, P, K, S, D)).astype(np.float32)
    return k, v


def _tables(rng, batch, width):
    pages = rng.permutation(np.arange(1, P))[: batch * width].reshape(batch, width)
    return pages.astype(np.int32)


def test_decode_attend_matches_oracle():
    rng = np.random.default_rng(0)
    batch, width = 4, 5
    k_pool, v_pool = _pool(rng)
    tables = _tables(rng, batch, width)
    tables[0, 1:] = 0  # unused entries -> null page
    positions = np.array([0, 7, 8, 37], np.int32)  # first token, page edges, last slot
    k_pool[:, 0] = np.nan  # the null page holds garbage
    v_pool[:, 0] = np.nan
    q = rng.normal(size=(batch, 1, H, D)).astype(np.float32)
    k_new = rng.normal(size=(batch, 1, K, D)).astype(np.float32)
    v_new = rng.normal(size=(batch, 1, K, D)).astype(np.float32)

    @jax.jit
    def both(k_pool, v_pool, tables, positions, q, k_new, v_new):
        write = jnp.ones(batch, bool)
        gather = attn.decode_attend(
            tables, positions, write, width, scale=SCALE, scatter=attn.plain_set
        )
        paged = attn.decode_attend_paged(tables, positions, write, width, scale=SCALE, impl="ref")
        full = _written(k_pool, v_pool, k_new, v_new, tables, positions[:, None], write[:, None])
        ours, via_paged, want = [], [], []
        gather_pools = paged_pools = (k_pool, v_pool)
        for layer in range(L):
            out, (_, gather_pools) = gather(q, k_new, v_new, (layer, gather_pools))
            ours.append(out[:, 0])
            out, (_, paged_pools) = paged(q, k_new, v_new, (layer, paged_pools))
            via_paged.append(out[:, 0])
            want.append(
                paged_decode_attention_ref(
                    q[:, 0], full[0][layer], full[1][layer], tables, positions + 1, scale=SCALE
                )
            )
        return (
            jnp.stack(ours),
            jnp.stack(via_paged),
            jnp.stack(want),
            gather_pools,
            paged_pools,
            full,
        )

    ours, via_paged, want, gather_pools, paged_pools, full = both(
        k_pool, v_pool, tables, positions, q, k_new, v_new
    )
    assert np.isfinite(np.asarray(ours)).all()
    np.testing.assert_allclose(np.asarray(ours), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(via_paged), np.asarray(want), rtol=2e-5, atol=2e-5)
    for pools in (gather_pools, paged_pools):  # both hooks wrote the same pool
        for got, expected in zip(pools, full):
            _assert_same_pool(got, expected)


def _written(k_pool, v_pool, k_new, v_new, tables, positions, write):
    """The pools with every layer's new K/V (the same for each layer) written."""
    out = []
    for pool, new in ((k_pool, k_new), (v_pool, v_new)):
        for layer in range(L):
            pool = attn.write_layer_kv(
                pool, layer, new, tables, positions, write, scatter=attn.plain_set
            )
        out.append(pool)
    return tuple(out)


def _assert_same_pool(got, expected):
    got, expected = np.asarray(got), np.asarray(expected)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(expected))


def test_prefill_attend_matches_oracle_with_cached_prefix_and_padding():
    rng = np.random.default_rng(1)
    batch, width, tokens = 3, 6, 8
    k_pool, v_pool = _pool(rng)
    tables = _tables(rng, batch, width)
    # Row 0: chunk at positions 16..23 after 16 cached; row 1: 16..20 then padding;
    # row 2: all padding (a filler row).
    positions = np.full((batch, tokens), -1, np.int32)
    positions[0] = np.arange(16, 24)
    positions[1, :5] = np.arange(16, 21)
    q = rng.normal(size=(batch, tokens, H, D)).astype(np.float32)
    k_new = rng.normal(size=(batch, tokens, K, D)).astype(np.float32)
    v_new = rng.normal(size=(batch, tokens, K, D)).astype(np.float32)
    window, layer = 2, 1  # 16 cached positions = 2 pages
    # Garbage where no live query may look: the filler row's pages (inside the gathered
    # window, so only the masks keep it out), the null page, and row 1's slots past its last
    # token (page 2 holds positions 16..23; 21..23 are unused).
    for pool in (k_pool, v_pool):
        pool[:, tables[2]] = np.nan
        pool[:, 0] = np.nan
        pool[:, tables[1, 2], :, 5:] = np.nan

    @jax.jit
    def both(k_pool, v_pool, tables, positions, q, k_new, v_new):
        attend = attn.prefill_attend(tables, window, positions, scale=SCALE, scatter=attn.plain_set)
        out, (_, pools) = attend(q, k_new, v_new, (layer, (k_pool, v_pool)))
        full = _written(k_pool, v_pool, k_new, v_new, tables, positions, positions >= 0)
        # The hook wrote only its own layer.
        written = tuple(p.at[1 - layer].set(f[1 - layer]) for p, f in zip(pools, full))
        want = paged_prefill_attention_ref(
            q, full[0][layer], full[1][layer], tables, positions, scale=SCALE
        )
        return out, want, written, full

    out, want, written, full = both(k_pool, v_pool, tables, positions, q, k_new, v_new)
    for got, expected in zip(written, full):
        _assert_same_pool(got, expected)
    assert np.isnan(k_pool[layer, tables[2, :window]]).all()  # the planted NaN is gathered
    valid = positions >= 0
    assert np.isfinite(np.asarray(out)).all()  # padding queries stay finite too
    np.testing.assert_allclose(
        np.asarray(out)[valid], np.asarray(want)[valid], rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize("scatter", [attn.plain_set, attn.set_at])
def test_write_layer_kv_targets_pages_and_null_page(scatter):
    pool = jnp.zeros((2, 5, 2, 4, 1))  # [L, P, K, S, D]
    new = jnp.arange(1, 7, dtype=jnp.float32).reshape(2, 3, 1, 1)
    new = jnp.concatenate([new, -new], axis=2)  # [B, T, K, D]; head 1 negated
    tables = jnp.asarray([[3, 1], [2, 4]], jnp.int32)
    positions = jnp.asarray([[3, 4, 5], [0, 1, -1]], jnp.int32)
    write = jax.jit(attn.write_layer_kv, static_argnames="scatter")
    for layer in (1, jnp.int32(1)):  # a Python int (unrolled layers) or traced (a layer scan)
        out = np.asarray(
            write(pool, layer, new, tables, positions, positions >= 0, scatter=scatter)
        )
        assert not out[0].any()  # the other layer is untouched
        np.testing.assert_array_equal(out[:, :, 1], -out[:, :, 0])
        out = out[1, :, 0, :, 0]  # layer 1, head 0: [P, S]
        assert out[3, 3] == 1 and out[1, 0] == 2 and out[1, 1] == 3
        assert out[2, 0] == 4 and out[2, 1] == 5
        assert out[0, 0] == 6  # the padding write went to the null page
        assert np.count_nonzero(out) == 6


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_set_at_equals_scatter_for_float_and_bit_views(dtype):
    """set_at writes exactly what `.at[].set` writes, on the array itself and on its uint16
    bit view (how the decode loop carries 16-bit caches), with out-of-range rows dropped."""
    rng = np.random.default_rng(7)
    base = jnp.asarray(rng.normal(size=(6, 3, 5)), dtype)
    values = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)  # cast to dtype on write
    rows, cols = jnp.asarray([0, 5, 2, 9]), jnp.asarray([4, 0, 4, 1])  # row 9: dropped
    index = (rows, slice(None), cols)
    want = base.at[index].set(values.astype(dtype), mode="drop")
    got = jax.jit(lambda a, v: attn.set_at(a, index, v, mode="drop"))(base, values)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    bits = attn.bits_view(base)
    assert bits.dtype == (jnp.float32 if dtype == jnp.float32 else jnp.uint16)
    got_bits = jax.jit(lambda a, v: attn.set_at(a, index, v, dtype=dtype, mode="drop"))(
        bits, values
    )
    assert got_bits.dtype == bits.dtype
    np.testing.assert_array_equal(
        np.asarray(attn.float_view(got_bits, dtype), np.float32), np.asarray(want, np.float32)
    )
