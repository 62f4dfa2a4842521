"""The jnp paged-attention reference against dense attention written by hand (float64 numpy).

Covers decode and causal chunked prefill, GQA, lengths 0/1/partial/exact/max, NaN-filled
garbage pages and slots, out-of-range garbage table entries, bf16 inputs, jit and no-jit.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pipelinerl_jax.kernels.paged_attention_ref import (
    PagedAttentionShapeError,
    decode_pages_per_step,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)

PAGE, PAGES_PER_SEQ = 4, 5


def make_cache(rng, *, lengths, kv_heads, head_dim, extra_pages=3):
    """Pages for each sequence (shuffled), NaN in every slot never written and in spare pages,
    and block-table entries past a sequence's pages that are garbage (NaN pages, out of range)."""
    batch = len(lengths)
    num_pages = batch * PAGES_PER_SEQ + extra_pages
    k = rng.standard_normal((num_pages, kv_heads, PAGE, head_dim))  # [P, K, S, D]
    v = rng.standard_normal((num_pages, kv_heads, PAGE, head_dim))
    spare = np.arange(batch * PAGES_PER_SEQ, num_pages)
    k[spare] = v[spare] = np.nan
    owned = rng.permutation(batch * PAGES_PER_SEQ).reshape(batch, PAGES_PER_SEQ)
    garbage = np.concatenate([spare, [-3, num_pages + 7]])
    tables = rng.choice(garbage, size=(batch, PAGES_PER_SEQ))
    for b, length in enumerate(lengths):
        used = -(-length // PAGE)
        tables[b, :used] = owned[b, :used]
        for pos in range(length, PAGES_PER_SEQ * PAGE):
            k[owned[b, pos // PAGE], :, pos % PAGE] = np.nan
            v[owned[b, pos // PAGE], :, pos % PAGE] = np.nan
    return k, v, tables.astype(np.int32)


def dense_kv(k, v, tables, b, length):
    """The first `length` cached positions of sequence b as dense [length, K, D] arrays."""
    rows = [(tables[b, pos // PAGE], pos % PAGE) for pos in range(length)]
    kv_shape = (length, k.shape[1], k.shape[3])
    return (
        np.array([k[p, :, s] for p, s in rows]).reshape(kv_shape),
        np.array([v[p, :, s] for p, s in rows]).reshape(kv_shape),
    )


def naive_attention(q_HxD, k_LxKxD, v_LxKxD, scale):
    """Softmax attention for one query token, head by head, in float64."""
    heads, head_dim = q_HxD.shape
    group = heads // k_LxKxD.shape[1]
    out = np.zeros((heads, head_dim))
    for h in range(heads):
        if len(k_LxKxD) == 0:
            continue
        s = k_LxKxD[:, h // group] @ q_HxD[h] * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v_LxKxD[:, h // group]
    return out


@pytest.mark.parametrize(
    "group, use_jit, pages_per_step",
    [
        (1, False, None),
        (2, True, None),
        (4, True, None),  # one block: no scan
        (2, False, 1),
        (4, True, 2),
        (1, True, 3),  # scan; 2 and 3 pad the 5-page table
    ],
)
def test_decode_matches_naive(group, use_jit, pages_per_step):
    rng = np.random.default_rng(group)
    lengths = [0, 1, 7, 8, PAGE * PAGES_PER_SEQ]  # zero, one, partial, exact pages, max
    kv_heads, head_dim = 2, 8
    k, v, tables = make_cache(rng, lengths=lengths, kv_heads=kv_heads, head_dim=head_dim)
    q = rng.standard_normal((len(lengths), kv_heads * group, head_dim))
    scale = 0.37
    fn = functools.partial(paged_decode_attention_ref, pages_per_step=pages_per_step)
    if use_jit:
        fn = jax.jit(fn, static_argnames="scale")
    out = np.asarray(
        fn(
            jnp.float32(q),
            jnp.float32(k),
            jnp.float32(v),
            tables,
            np.asarray(lengths, np.int32),
            scale=scale,
        )
    )
    assert out.dtype == np.float32 and np.isfinite(out).all()
    for b, length in enumerate(lengths):
        want = naive_attention(q[b], *dense_kv(k, v, tables, b, length), scale)
        np.testing.assert_allclose(out[b], want, atol=2e-5, rtol=1e-5)
    assert np.all(out[0] == 0)  # length 0 gives exact zeros


def test_pages_per_step_sizes():
    """The bench model (4 kv heads, head_dim 64, page 16): one block up to 24 MB of gathered
    K and V, 4 MB blocks (at least 32 tokens) beyond."""
    sizes = {b: decode_pages_per_step(b, 16, 10, 4, 64, 4) for b in (1, 8, 32, 64)}
    assert sizes == {1: 10, 8: 10, 32: 10, 64: 10}  # context 160: one block
    sizes = {b: decode_pages_per_step(b, 16, 64, 4, 64, 4) for b in (8, 16, 32, 64, 256)}
    assert sizes == {8: 64, 16: 8, 32: 4, 64: 2, 256: 2}  # context 1024
    assert decode_pages_per_step(64, 16, 128, 8, 128, 2) == 2  # 8B-like, long context


def test_decode_bf16_keeps_dtype_and_accuracy():
    rng = np.random.default_rng(7)
    lengths = [3, 20, 12]
    k, v, tables = make_cache(rng, lengths=lengths, kv_heads=2, head_dim=16)
    q = rng.standard_normal((3, 8, 16))
    bf = ml_dtypes.bfloat16
    out = jax.jit(paged_decode_attention_ref, static_argnames="scale")(
        jnp.asarray(q, bf),
        jnp.asarray(k, bf),
        jnp.asarray(v, bf),
        tables,
        np.asarray(lengths),
        scale=0.25,
    )
    assert out.dtype == jnp.bfloat16
    q32, k32, v32 = (np.asarray(x.astype(bf), np.float64) for x in (q, k, v))
    for b, length in enumerate(lengths):
        want = naive_attention(q32[b], *dense_kv(k32, v32, tables, b, length), 0.25)
        np.testing.assert_allclose(np.asarray(out[b], np.float32), want, atol=1.6e-2)


def test_prefill_matches_naive_causal():
    rng = np.random.default_rng(3)
    kv_heads, group, head_dim, chunk = 2, 2, 8, 6
    # Sequence 0: chunk at positions 9..14 after a cached prefix; 1: first chunk 0..3 then
    # padding; 2: all padding; 3: chunk ending at the last slot of its table.
    positions = np.array(
        [
            list(range(9, 15)),
            [0, 1, 2, 3, -1, -1],
            [-1] * chunk,
            list(range(PAGE * PAGES_PER_SEQ - chunk, PAGE * PAGES_PER_SEQ)),
        ],
        np.int32,
    )
    lengths = [int(p.max()) + 1 for p in positions]  # everything up to the last query written
    k, v, tables = make_cache(rng, lengths=lengths, kv_heads=kv_heads, head_dim=head_dim)
    q = rng.standard_normal((len(positions), chunk, kv_heads * group, head_dim))
    fn = jax.jit(paged_prefill_attention_ref, static_argnames="scale")
    out = np.asarray(
        fn(jnp.float32(q), jnp.float32(k), jnp.float32(v), tables, positions, scale=0.5)
    )
    assert np.isfinite(out).all()
    for b in range(len(positions)):
        for t, pos in enumerate(positions[b]):
            want = naive_attention(q[b, t], *dense_kv(k, v, tables, b, pos + 1), 0.5)
            np.testing.assert_allclose(out[b, t], want, atol=2e-5, rtol=1e-5)
    assert np.all(out[2] == 0) and np.all(out[1, 4:] == 0)  # padding queries give zeros


def test_prefill_query_equals_decode_at_same_position():
    """A prefill query at position p sees exactly what decode sees with length p + 1."""
    rng = np.random.default_rng(11)
    k, v, tables = make_cache(rng, lengths=[13, 20], kv_heads=1, head_dim=8)
    q = jnp.float32(rng.standard_normal((2, 3, 4, 8)))
    positions = np.array([[10, 11, 12], [17, 18, 19]], np.int32)
    pre = jax.jit(paged_prefill_attention_ref, static_argnames="scale")(
        q, k, v, tables, positions, scale=0.3
    )
    decode = jax.jit(paged_decode_attention_ref, static_argnames="scale")
    for t in range(3):
        dec = decode(q[:, t], k, v, tables, positions[:, t] + 1, scale=0.3)
        np.testing.assert_allclose(pre[:, t], dec, atol=1e-6)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(v=np.zeros((4, 4, 2, 8), np.float32)), "equal shapes"),
        (dict(q=np.zeros((2, 3, 8), np.float32)), "not a multiple"),
        (dict(q=np.zeros((2, 4, 16), np.float32)), "head_dim"),
        (dict(q=np.zeros((4, 8), np.float32)), "batch, heads, head_dim"),
        (dict(tables=np.zeros((3, 5), np.int32)), "block_tables"),
        (dict(tables=np.zeros((2, 5), np.float32)), "integer"),
        (dict(lengths=np.zeros((3,), np.int32)), "lengths"),
        (dict(v=np.zeros((5, 4, 2, 8), np.float16)), "dtype"),
    ],
)
def test_decode_bad_inputs_name_the_tensor(bad, match):
    args = dict(
        q=np.zeros((2, 4, 8), np.float32),
        k=np.zeros((5, 4, 2, 8), np.float32),
        v=np.zeros((5, 4, 2, 8), np.float32),
        tables=np.zeros((2, 5), np.int32),
        lengths=np.zeros((2,), np.int32),
    )
    args.update(bad)
    with pytest.raises(PagedAttentionShapeError, match=match):
        paged_decode_attention_ref(
            args["q"], args["k"], args["v"], args["tables"], args["lengths"], scale=1.0
        )


def test_prefill_bad_positions_shape():
    k = np.zeros((5, 4, 2, 8), np.float32)
    with pytest.raises(PagedAttentionShapeError, match="q_positions"):
        paged_prefill_attention_ref(
            np.zeros((2, 3, 4, 8), np.float32),
            k,
            k,
            np.zeros((2, 5), np.int32),
            np.zeros((2, 4), np.int32),
            scale=1.0,
        )
