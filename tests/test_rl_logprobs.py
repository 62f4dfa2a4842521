"""Chunked and fused f32 logprobs against a whole-vocabulary log-softmax (rl/logprobs.py)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.rl.logprobs import chunked_logprobs, full_logprobs, fused_token_loss

B, T, E, V = 3, 5, 16, 37  # 15 tokens; V is not a multiple of the chunk sizes used


def _inputs(dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 5)
    h = jax.random.normal(k[0], (B, T, E)).astype(dtype)
    w = (0.5 * jax.random.normal(k[1], (E, V))).astype(dtype)
    t = jax.random.randint(k[2], (B, T), 0, V)
    return h, w, t, jax.random.normal(k[3], (B, T)), jax.random.normal(k[4], (B, T))


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("temperature,chunk", [(1.0, 8), (0.7, 37)])
def test_chunked_matches_full_values_and_grads(temperature, chunk):
    h, w, t, g_lp, g_ent = _inputs()

    def value_and_grads(fn):
        def f(h, w):
            lp, ent = fn(h, w)
            return jnp.sum(g_lp * lp + g_ent * ent), (lp, ent)

        return jax.grad(f, (0, 1), has_aux=True)(h, w)

    # One jit around both paths: a single compile instead of one per eager primitive.
    (got, (lp, ent)), (want, (lp_ref, ent_ref)) = jax.jit(
        lambda h, w: (
            value_and_grads(
                lambda h, w: chunked_logprobs(h, w, t, temperature=temperature, vocab_chunk=chunk)
            ),
            value_and_grads(lambda h, w: full_logprobs(h, w, t, temperature=temperature)),
        )
    )(h, w)
    _close(lp, lp_ref)
    _close(ent, ent_ref)
    for a, b in zip(got, want):
        _close(a, b)


@pytest.mark.parametrize("token_chunk", [4, 64])
def test_fused_matches_full_values_and_grads(token_chunk):
    h, w, t, a, b = _inputs()
    inputs = {"a": a, "b": b}

    def token_loss(lp, ent, inp):
        return jnp.sum(inp["a"] * lp + inp["b"] * ent * ent)

    def fused(h, w):
        return fused_token_loss(
            h, w, t, inputs, token_loss, temperature=0.8, token_chunk=token_chunk
        )[0]

    def full(h, w):
        lp, ent = full_logprobs(h, w, t, temperature=0.8)
        return token_loss(lp, ent, inputs)

    def both(h, w):
        loss, lp, ent = fused_token_loss(
            h, w, t, inputs, token_loss, temperature=0.8, token_chunk=token_chunk
        )
        return (
            loss,
            full(h, w),
            lp,
            ent,
            full_logprobs(h, w, t, temperature=0.8),
            jax.grad(fused, (0, 1))(h, w),
            jax.grad(full, (0, 1))(h, w),
        )

    loss, loss_ref, lp, ent, (lp_ref, ent_ref), got, want = jax.jit(both)(h, w)
    _close(loss, loss_ref, 1e-4)
    _close(lp, lp_ref)
    _close(ent, ent_ref)
    for x, y in zip(got, want):
        _close(x, y)


def test_bf16_inputs_give_bf16_grads_from_f32_math():
    h, w, t, g_lp, _ = _inputs(jnp.bfloat16)
    f = lambda h, w: jnp.sum(g_lp * chunked_logprobs(h, w, t, vocab_chunk=8)[0])
    (dh, dw), lp, lp_ref = jax.jit(
        lambda h, w: (
            jax.grad(f, (0, 1))(h, w),
            chunked_logprobs(h, w, t, vocab_chunk=8)[0],
            full_logprobs(h, w, t)[0],
        )
    )(h, w)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    assert lp.dtype == jnp.float32
    _close(lp, lp_ref, 1e-4)


def _rounded(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


@pytest.mark.parametrize("path", ["chunked", "fused"])
def test_bf16_head_is_f32_math_on_bf16_rounded_operands(path):
    """head_dtype="bfloat16": the values are those of the f32 head on the bf16-rounded hidden
    states and head (f32 accumulation), not those of the unrounded f32 inputs; the gradients
    are the reference's up to rounding d logits to bf16 (as torch autocast does)."""
    h, w, t, a, b = _inputs()
    inputs = {"a": a, "b": b}

    def token_loss(lp, ent, inp):
        return jnp.sum(inp["a"] * lp + inp["b"] * ent)

    def ours(h, w):
        if path == "fused":
            loss, lp, ent = fused_token_loss(
                h, w, t, inputs, token_loss, token_chunk=4, head_dtype="bfloat16"
            )
            return loss, (lp, ent)
        lp, ent = chunked_logprobs(h, w, t, vocab_chunk=8, head_dtype="bfloat16")
        return token_loss(lp, ent, inputs), (lp, ent)

    def reference(h, w):
        lp, ent = full_logprobs(_rounded(h), _rounded(w), t)
        return token_loss(lp, ent, inputs), (lp, ent)

    (loss, (lp, ent)), grads = jax.jit(jax.value_and_grad(ours, (0, 1), has_aux=True))(h, w)
    (loss_ref, (lp_ref, ent_ref)), grads_ref = jax.value_and_grad(reference, (0, 1), has_aux=True)(
        h, w
    )
    _close(lp, lp_ref, 1e-4)
    _close(ent, ent_ref, 1e-4)
    _close(loss, loss_ref, 1e-3)
    unrounded, _ = full_logprobs(h, w, t)
    assert float(jnp.max(jnp.abs(lp - unrounded))) > 1e-3  # the head really ran on bf16
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.dtype == jnp.float32
        _close(g, g_ref, 3e-2)


def _shapes(jaxpr, out):
    for eqn in jaxpr.eqns:
        out.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _shapes(sub, out)
    return out


def test_no_whole_vocabulary_f32_logits_in_forward_or_backward():
    h, w, t, g_lp, g_ent = _inputs()
    n = B * T

    def chunked(h, w):
        lp, ent = chunked_logprobs(h, w, t, vocab_chunk=8)
        return jnp.sum(g_lp * lp + g_ent * ent)

    def fused(h, w):
        return fused_token_loss(
            h, w, t, {"a": g_lp}, lambda lp, ent, i: jnp.sum(i["a"] * lp), token_chunk=4
        )[0]

    full_shapes = _shapes(
        jax.make_jaxpr(jax.grad(lambda h, w: jnp.sum(full_logprobs(h, w, t)[0]), (0, 1)))(
            h, w
        ).jaxpr,
        set(),
    )
    assert (B, T, V) in full_shapes  # the check can see a whole-vocabulary array
    for fn, biggest in ((chunked, (n, 8)), (fused, (4, V))):
        shapes = _shapes(jax.make_jaxpr(jax.grad(fn, (0, 1)))(h, w).jaxpr, set())
        assert biggest in shapes
        assert not {(n, V), (B, T, V), (n, 40)} & shapes, shapes
