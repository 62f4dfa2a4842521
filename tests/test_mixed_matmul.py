"""models/mixed_matmul.py: 16-bit operands, f32 accumulation, forward and backward.

Checked against plain f32 autodiff of the same bf16-rounded operands (what the custom VJP must
equal up to summation order), in the compositions users write (grad of jit, lax.scan gradient
accumulation, jax.checkpoint), and structurally: on CPU every matmul of the bf16 backward keeps
bf16 operands, where JAX's own transpose rule leaves f32 ones (the reason the module exists).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.models import block
from pipelinerl_jax.models.mixed_matmul import lhs_transposed, mixed_matmul

BF16 = jnp.bfloat16


def _inputs(seed, n=96, i=40, o=56):
    kx, kw, kr = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (n, i), jnp.float32)
    w = jax.random.normal(kw, (i, o), jnp.float32) / np.sqrt(i)
    r = jax.random.normal(kr, (n, o), jnp.float32)
    return x, w, r


def _reference_grads(x, w, r, out_dtype):
    """f32 autodiff of the rounded operands; the cotangent rounded as the backward rounds it."""

    def loss(x, w):
        y = jnp.dot(x.astype(BF16).astype(jnp.float32), w.astype(BF16).astype(jnp.float32))
        return jnp.sum(y.astype(out_dtype).astype(jnp.float32) * r)

    g = r.astype(out_dtype).astype(BF16).astype(jnp.float32)  # d loss / d y, rounded
    xr, wr = x.astype(BF16).astype(jnp.float32), w.astype(BF16).astype(jnp.float32)
    return loss(x, w), g @ wr.T, xr.T @ g


@pytest.mark.parametrize("out_dtype", [jnp.float32, BF16])
def test_value_and_grads_match_f32_autodiff_of_rounded_operands(out_dtype):
    x, w, r = _inputs(0)

    def loss(x, w):
        return jnp.sum(mixed_matmul(x, w, BF16, out_dtype).astype(jnp.float32) * r)

    val, (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
    ref_val, ref_dx, ref_dw = _reference_grads(x, w, r, out_dtype)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    np.testing.assert_allclose(val, ref_val, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-4)


def test_grads_of_bf16_operands_come_back_bf16_and_equal_plain_autodiff():
    """What the model's projections do: bf16 x and w, bf16 result. Plain autodiff computes the
    same numbers (the bf16 cotangent rounds to itself), through f32 matmuls."""
    x, w, r = _inputs(1)
    xb, wb = x.astype(BF16), w.astype(BF16)

    def plain(x, w):
        y = jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(BF16)
        return jnp.sum(y.astype(jnp.float32) * r)

    def mixed(x, w):
        return jnp.sum(mixed_matmul(x, w, BF16).astype(jnp.float32) * r)

    got = jax.grad(mixed, argnums=(0, 1))(xb, wb)
    want = jax.grad(plain, argnums=(0, 1))(xb, wb)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == BF16
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-2)


def test_compositions_grad_of_jit_scan_accumulation_and_checkpoint():
    x, w, r = _inputs(2, n=64)

    def loss(x, w, r):
        return jnp.sum(mixed_matmul(x, w, BF16, jnp.float32) * r)

    whole = jax.grad(loss, argnums=1)(x, w, r)
    via_jit = jax.grad(jax.jit(loss), argnums=1)(x, w, r)
    via_ckpt = jax.jit(jax.grad(jax.checkpoint(loss), argnums=1))(x, w, r)

    def accumulate(w):
        def body(acc, xr):
            return acc + jax.grad(loss, argnums=1)(xr[0], w, xr[1]), None

        xs = (x.reshape(4, 16, -1), r.reshape(4, 16, -1))
        return jax.lax.scan(body, jnp.zeros_like(w), xs)[0]

    via_scan = jax.jit(accumulate)(w)
    for got in (via_jit, via_ckpt, via_scan):
        np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5)


def test_lhs_transposed_is_the_transpose():
    x = jax.random.normal(jax.random.key(3), (7, 5), jnp.float32).astype(BF16)
    np.testing.assert_array_equal(jax.jit(lhs_transposed)(x), x.T)
    np.testing.assert_array_equal(lhs_transposed(x[:1]), x[:1].T)
    odd = jax.random.normal(jax.random.key(4), (9, 3), jnp.float32)
    for dtype in (jnp.float32, jnp.float16, BF16):
        for as_bits in (True, False):
            got = jax.jit(lambda v, b=as_bits: lhs_transposed(v, as_bits=b))(odd.astype(dtype))
            np.testing.assert_array_equal(got, odd.T.astype(dtype))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's copy lowering")
def test_lhs_transposed_moves_16_bit_values_as_16_bit_words():
    """The copy is a bit move: no f32 array may appear in it (XLA:CPU routes a bf16 transpose
    through f32 when the values are left as bf16)."""
    x = jax.random.normal(jax.random.key(5), (64, 24), jnp.float32).astype(BF16)
    text = jax.jit(lhs_transposed).lower(x).compile().as_text()
    assert "f32[" not in text
    assert "u16[" in text


def _dot_operand_types(fn, *args) -> list[tuple[str, str]]:
    """Element types of both operands of every dot in fn's compiled (optimised) HLO."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    found = []
    for body in re.split(r"\n\n", text):
        types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", body))
        for a, b in re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", body):
            found.append((types.get(a, "?"), types.get(b, "?")))
    return found


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's matmul rewrite")
def test_bf16_backward_keeps_bf16_matmul_operands_on_cpu():
    """The custom VJP's three matmuls take bf16 operands; JAX's own transpose of the same
    forward leaves f32 ones (an f32 cotangent against a bf16 operand), which XLA runs as f32."""
    x, w, r = _inputs(4, n=256, i=128, o=192)
    xb, wb = x.astype(BF16), w.astype(BF16)

    def plain(x, w):
        y = jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(BF16)
        return jnp.sum(y.astype(jnp.float32) * r)

    def mixed(x, w):
        return jnp.sum(block.dense(x, w, 1).astype(jnp.float32) * r)

    plain_dots = _dot_operand_types(jax.value_and_grad(plain, argnums=(0, 1)), xb, wb)
    mixed_dots = _dot_operand_types(jax.value_and_grad(mixed, argnums=(0, 1)), xb, wb)
    assert len(mixed_dots) == 3, mixed_dots
    assert all(t == ("bf16", "bf16") for t in mixed_dots), mixed_dots
    assert any("f32" in t for t in plain_dots), plain_dots
