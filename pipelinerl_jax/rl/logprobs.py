"""Target-token logprobs and entropy from hidden states and the LM head, in bounded f32 memory.

logits = hidden @ W / temperature is never materialised whole as [tokens, V] in f32: with a
150k vocabulary that is 600 kB per token. Two ways through, both exact:

- `chunked_logprobs`: scan over vocabulary chunks with an online logsumexp (running max m,
  sum of exp s, exp-weighted logit sum t, giving lse = m + log s and entropy = lse - t/s). The
  backward recomputes each chunk's logits (custom_vjp), so only [N, Vc] exists at a time; it
  costs one extra head matmul. Used for reference logprobs and for objectives whose per-token
  gradient needs whole sequences first (gspo).
- `fused_token_loss`: for losses that are a sum of per-token terms f(logprob, entropy, inputs),
  the forward pass walks token chunks with the full vocabulary, and since each token's
  gradient is known as soon as its row of logits is, computes the head's gradients right there
  (3 matmuls, like plain autodiff, no recompute) and keeps them as residuals. Used by
  tis_reinforce and ppo.

`head_dtype` picks the head's matmul precision: float32 (the default: f32 operands at the
highest precision on every backend, so trainer logprobs match the sampler's f32 head) or a
16-bit dtype (bf16 operands accumulated in f32, as torch autocast runs the head; forward and
backward through models/mixed_matmul.py). The softmax and the loss stay f32 either way.

Chunks are strided (chunk j holds ids j, j + n, j + 2n, ...) so that reshaping a sharded axis
keeps every chunk spread over the same devices. Letters (pipelinerl_jax/__init__.py):
N tokens, E hidden, V vocabulary,
C chunks, Vc / Nc chunk sizes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp

from pipelinerl_jax.kernels import target
from pipelinerl_jax.models.mixed_matmul import lhs_transposed, mixed_matmul

_NEG = -1e30  # finite "minus infinity": keeps p * (z - mean) at 0 instead of NaN
_HIGHEST = jax.lax.Precision.HIGHEST  # f32 head on every backend (no TF32 on GPUs)


def _head_dot(a_MxK, b_KxV, head_dtype) -> jax.Array:
    """a @ b in f32: f32 operands at HIGHEST precision, or head_dtype operands, f32 accumulated."""
    if jnp.dtype(head_dtype) == jnp.float32:
        return jnp.dot(a_MxK.astype(jnp.float32), b_KxV.astype(jnp.float32), precision=_HIGHEST)
    return mixed_matmul(a_MxK, b_KxV, head_dtype, jnp.float32)


def _head_lhs_T(h_NxE, head_dtype) -> jax.Array:
    """h^T [E, N] as the left operand of the head's weight gradient: a plain transpose for the
    f32 head, the 16-bit matmul's own copy otherwise (models/mixed_matmul.lhs_transposed)."""
    if jnp.dtype(head_dtype) == jnp.float32:
        return h_NxE.T
    return lhs_transposed(h_NxE.astype(head_dtype))


def _strided_chunks(x, axis_size: int, chunk: int, axis: int):
    """Pads `axis` to C*chunk and splits it into C strided chunks, moved to the front."""
    num = math.ceil(axis_size / chunk)
    pad = num * chunk - axis_size
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths)
    shape = x.shape[:axis] + (chunk, num) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis + 1, 0), num


def _unchunk(x_Cx, axis_size: int, axis: int):
    """Inverse of _strided_chunks for an array whose chunk axis is in front."""
    num, chunk = x_Cx.shape[0], x_Cx.shape[axis + 1]
    x = jnp.moveaxis(x_Cx, 0, axis + 1)
    x = x.reshape(x.shape[:axis] + (chunk * num,) + x.shape[axis + 2 :])
    return jax.lax.slice_in_dim(x, 0, axis_size, axis=axis)


def _vocab_chunks(w_ExV, vocab_chunk: int):
    V = w_ExV.shape[1]
    Vc = min(vocab_chunk, V)
    w_CxExVc, num = _strided_chunks(w_ExV.astype(jnp.float32), V, Vc, axis=1)
    ids_CxVc = jnp.arange(Vc)[None, :] * num + jnp.arange(num)[:, None]
    return w_CxExVc, ids_CxVc < V


def _rounded(x, head_dtype):
    """x as the head's matmul sees it (rounded to head_dtype), in f32."""
    return x.astype(head_dtype).astype(jnp.float32)


def _target_logits(h_NxE, w_ExV, targets_N, temperature, head_dtype):
    w_NxE = _rounded(jnp.take(w_ExV.T, targets_N, axis=0), head_dtype)
    return jnp.sum(_rounded(h_NxE, head_dtype) * w_NxE, axis=-1) / temperature, w_NxE


def _chunked_forward(h_NxE, w_ExV, targets_N, temperature, vocab_chunk, head_dtype):
    w_CxExVc, valid_CxVc = _vocab_chunks(w_ExV, vocab_chunk)
    N = h_NxE.shape[0]

    def body(carry, xs):
        m_N, s_N, t_N = carry
        w_ExVc, valid_Vc = xs
        z_NxVc = _head_dot(h_NxE, w_ExVc, head_dtype) / temperature
        z_NxVc = jnp.where(valid_Vc, z_NxVc, _NEG)
        m_new = jnp.maximum(m_N, z_NxVc.max(axis=-1))
        scale = jnp.exp(m_N - m_new)
        e_NxVc = jnp.exp(z_NxVc - m_new[:, None])
        return (m_new, s_N * scale + e_NxVc.sum(-1), t_N * scale + (e_NxVc * z_NxVc).sum(-1)), None

    init = (
        jnp.full((N,), _NEG, jnp.float32),
        jnp.zeros((N,), jnp.float32),
        jnp.zeros((N,), jnp.float32),
    )
    (m_N, s_N, t_N), _ = jax.lax.scan(body, init, (w_CxExVc, valid_CxVc))
    lse_N = m_N + jnp.log(s_N)
    mean_z_N = t_N / s_N
    zt_N, _ = _target_logits(h_NxE, w_ExV, targets_N, temperature, head_dtype)
    return zt_N - lse_N, lse_N - mean_z_N, (lse_N, mean_z_N)


def _flatten(hidden, targets):
    E = hidden.shape[-1]
    return hidden.reshape(-1, E).astype(jnp.float32), targets.reshape(-1)


# The custom VJPs below are module-level functions of explicit arguments: every array they use
# (targets included) is a primal input, and only hashable Python values (temperature, chunk
# sizes, dtypes, the closure-converted loss) are nondiff_argnums. A rule that closed over an
# array of the caller's trace would leak it as soon as its differentiation happened outside that
# trace: grad(jit(f)), grad through lax.scan (gradient accumulation), jax.checkpoint.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked(hidden_xE, w_ExV, targets, temperature, vocab_chunk, head_dtype):
    h_NxE, t_N = _flatten(hidden_xE, targets)
    lp_N, ent_N, _ = _chunked_forward(h_NxE, w_ExV, t_N, temperature, vocab_chunk, head_dtype)
    return lp_N, ent_N


def _chunked_fwd(hidden_xE, w_ExV, targets, temperature, vocab_chunk, head_dtype):
    h_NxE, t_N = _flatten(hidden_xE, targets)
    lp_N, ent_N, (lse_N, mean_z_N) = _chunked_forward(
        h_NxE, w_ExV, t_N, temperature, vocab_chunk, head_dtype
    )
    return (lp_N, ent_N), (hidden_xE, w_ExV, targets, lse_N, mean_z_N)


def _chunked_bwd(temperature, vocab_chunk, head_dtype, res, cotangents):
    hidden_xE, w_ExV, targets, lse_N, mean_z_N = res
    g_lp_N, g_ent_N = cotangents
    h_NxE, t_N = _flatten(hidden_xE, targets)
    w_CxExVc, valid_CxVc = _vocab_chunks(w_ExV, vocab_chunk)
    hT_ExN = _head_lhs_T(h_NxE, head_dtype)

    def body(dh_NxE, xs):
        w_ExVc, valid_Vc = xs
        z_NxVc = _head_dot(h_NxE, w_ExVc, head_dtype) / temperature
        p_NxVc = jnp.where(valid_Vc, jnp.exp(z_NxVc - lse_N[:, None]), 0.0)
        # d logprob / dz = onehot - p (onehot added below); d entropy / dz = -p (z - E_p[z]).
        dz_NxVc = -p_NxVc * (g_lp_N[:, None] + g_ent_N[:, None] * (z_NxVc - mean_z_N[:, None]))
        dz_NxVc = dz_NxVc / temperature
        dh_NxE = dh_NxE + _head_dot(dz_NxVc, w_ExVc.T, head_dtype)
        return dh_NxE, _head_dot(hT_ExN, dz_NxVc, head_dtype)

    dh_NxE, dw_CxExVc = jax.lax.scan(body, jnp.zeros_like(h_NxE), (w_CxExVc, valid_CxVc))
    dw_ExV = _unchunk(dw_CxExVc, w_ExV.shape[1], axis=1)
    _, w_NxE = _target_logits(h_NxE, w_ExV, t_N, temperature, head_dtype)
    g_t_N = g_lp_N / temperature
    dh_NxE = dh_NxE + g_t_N[:, None] * w_NxE
    dw_ExV = dw_ExV.at[:, t_N].add((g_t_N[:, None] * _rounded(h_NxE, head_dtype)).T)
    # Integer targets take no cotangent (None: a symbolic zero, float0 as JAX requires).
    return (
        dh_NxE.reshape(hidden_xE.shape).astype(hidden_xE.dtype),
        dw_ExV.astype(w_ExV.dtype),
        None,
    )


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_logprobs(
    hidden_xE,
    w_ExV,
    targets,
    *,
    temperature: float = 1.0,
    vocab_chunk: int = 8192,
    head_dtype="float32",
):
    """(logprobs, entropy) f32 with targets' shape, of softmax(hidden @ W / temperature).

    hidden_xE: [..., E] any float dtype; w_ExV: the LM head; targets: int [...]. Differentiable
    in hidden and W; the backward recomputes one vocabulary chunk at a time. Composes with jit,
    vmap, scan and checkpoint in any order (see the note above _chunked).
    """
    shape = targets.shape
    lp_N, ent_N = _chunked(
        hidden_xE, w_ExV, targets, temperature, vocab_chunk, jnp.dtype(head_dtype)
    )
    return lp_N.reshape(shape), ent_N.reshape(shape)


def full_logprobs(hidden_xE, w_ExV, targets, *, temperature: float = 1.0):
    """Reference: the same quantities from whole f32 logits (tests, tiny vocabularies)."""
    z = (
        jnp.dot(hidden_xE.astype(jnp.float32), w_ExV.astype(jnp.float32), precision=_HIGHEST)
        / temperature
    )
    logp = jax.nn.log_softmax(z, axis=-1)
    lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return lp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def _token_chunk_grads(h_NcxE, w_ExV, t_Nc, inputs, loss_fn, temperature, head_dtype):
    """One token chunk's (loss, logprobs, entropy, d loss / d h, d loss / d W), from its
    whole-vocabulary logits, with the softmax gradient written out.

    Autodiff of logsumexp, the target pick and the entropy sum walked the [Nc, V] logits
    several more times (each exp and select again in the backward); here the logits are read
    by one max, one pass for both softmax sums, and the one pass that forms d logits.
    d logprob / dz = onehot - p; d entropy / dz = -p (z - E_p[z]).
    """
    f32 = jnp.float32
    z_NcxV = _head_dot(h_NcxE, w_ExV, head_dtype) / temperature
    m_Nc = jnp.max(z_NcxV, axis=-1)
    e_NcxV = jnp.exp(z_NcxV - m_Nc[:, None])
    s_Nc = jnp.sum(e_NcxV, axis=-1)
    mean_z_Nc = jnp.sum(e_NcxV * z_NcxV, axis=-1) / s_Nc
    lse_Nc = m_Nc + jnp.log(s_Nc)
    zt_Nc = jnp.take_along_axis(z_NcxV, t_Nc[:, None], axis=-1)[:, 0]
    lp_Nc, ent_Nc = zt_Nc - lse_Nc, lse_Nc - mean_z_Nc
    loss_c, pullback = jax.vjp(lambda lp, ent: loss_fn(lp, ent, inputs), lp_Nc, ent_Nc)
    g_lp_Nc, g_ent_Nc = pullback(jnp.ones((), loss_c.dtype))
    # A compare-select rather than a scatter: it fuses into the pass that forms d logits.
    hit_NcxV = jnp.arange(z_NcxV.shape[-1])[None, :] == t_Nc[:, None]
    p_NcxV = e_NcxV / s_Nc[:, None]
    dz_NcxV = jnp.where(hit_NcxV, g_lp_Nc[:, None], 0.0) - p_NcxV * (
        g_lp_Nc[:, None] + g_ent_Nc[:, None] * (z_NcxV - mean_z_Nc[:, None])
    )
    dz_NcxV = (dz_NcxV / temperature).astype(f32)
    hT_ExNc = _head_lhs_T(h_NcxE, head_dtype)
    dh_NcxE = _head_dot(dz_NcxV, w_ExV.T, head_dtype)
    dw_ExV = _head_dot(hT_ExNc, dz_NcxV, head_dtype)
    return loss_c, lp_Nc, ent_Nc, dh_NcxE.astype(h_NcxE.dtype), dw_ExV


def _closure_convert(fn, *example_args):
    """(converted, consts): converted(*args, *consts) == fn(*args), no array left in a closure.

    Like jax.closure_convert, but hoists every closed-over value, integer tracers included
    (jax.closure_convert keeps those closed over, and they would leak just the same).
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*example_args)
    jaxpr, out_tree, num_args = closed.jaxpr, jax.tree.structure(out_shape), len(example_args)

    def converted(*args_and_consts):
        args, consts = args_and_consts[:num_args], args_and_consts[num_args:]
        run = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(jaxpr, list(consts)))
        return jax.tree.unflatten(out_tree, run(*jax.tree.leaves(args)))

    return converted, list(closed.consts)


def _fused_forward(
    chunk_loss, temperature, Nc, head_dtype, hidden_xE, w_ExV, targets, inputs, consts
):
    """((loss, logprobs, entropy), (d loss / d hidden, d loss / d W)) in one pass."""
    shape = targets.shape
    N = math.prod(shape)
    h_NxE, t_N = _flatten(hidden_xE, targets)
    w32_ExV = w_ExV.astype(jnp.float32)
    h_CxNcxE, _ = _strided_chunks(h_NxE, N, Nc, axis=0)
    t_CxNc, _ = _strided_chunks(t_N, N, Nc, axis=0)
    inp_C = jax.tree.map(lambda x: _strided_chunks(x.reshape(-1), N, Nc, axis=0)[0], inputs)

    def loss_fn(lp_Nc, ent_Nc, inp):
        return chunk_loss(lp_Nc, ent_Nc, inp, *consts)

    def body(carry, xs):
        loss, dw_ExV = carry
        h_NcxE, t_Nc, inp = xs
        loss_c, lp_Nc, ent_Nc, dh_NcxE, dw_c = _token_chunk_grads(
            h_NcxE, w32_ExV, t_Nc, inp, loss_fn, temperature, head_dtype
        )
        return (loss + loss_c, dw_ExV + dw_c), (lp_Nc, ent_Nc, dh_NcxE)

    init = (jnp.zeros((), jnp.float32), jnp.zeros_like(w32_ExV))
    (loss, dw_ExV), (lp, ent, dh) = jax.lax.scan(body, init, (h_CxNcxE, t_CxNc, inp_C))
    if jnp.dtype(head_dtype).itemsize == 2 and target.platform() == "cpu":
        # A tied head's gradient is wanted as [V, E]: XLA:CPU then lays the accumulator out
        # transposed and emits the chunk's bf16 weight-gradient dot with both operands
        # contracted on their outer axes, which its DotThunk cannot run (bf16 x bf16 = f32).
        # The barrier keeps the accumulator [E, V]; the transpose comes after the loop.
        dw_ExV = jax.lax.optimization_barrier(dw_ExV)
    lp_N, ent_N = _unchunk(lp, N, 0), _unchunk(ent, N, 0)
    dh_xE = _unchunk(dh, N, 0).reshape(hidden_xE.shape)
    return (loss, lp_N.reshape(shape), ent_N.reshape(shape)), (dh_xE, dw_ExV)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused(chunk_loss, temperature, Nc, dtypes, hidden_xE, w_ExV, targets, inputs, consts):
    head_dtype = dtypes[2]
    args = (hidden_xE, w_ExV, targets, inputs, consts)
    return _fused_forward(chunk_loss, temperature, Nc, head_dtype, *args)[0]


def _fused_fwd(chunk_loss, temperature, Nc, dtypes, hidden_xE, w_ExV, targets, inputs, consts):
    head_dtype = dtypes[2]
    args = (hidden_xE, w_ExV, targets, inputs, consts)
    out, (dh_xE, dw_ExV) = _fused_forward(chunk_loss, temperature, Nc, head_dtype, *args)
    return out, (dh_xE, dw_ExV)


def _fused_bwd(chunk_loss, temperature, Nc, dtypes, res, cotangents):
    dh_xE, dw_ExV = res
    h_dtype, w_dtype, _ = dtypes
    g = cotangents[0]  # the logprob/entropy outputs are stop-gradient'ed by fused_token_loss
    # targets, inputs and the loss's closed-over values are constants: no cotangent (None).
    return (g * dh_xE).astype(h_dtype), (g * dw_ExV).astype(w_dtype), None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_token_loss(
    hidden_xE,
    w_ExV,
    targets,
    inputs: Any,
    loss_fn: Callable[[jax.Array, jax.Array, Any], jax.Array],
    *,
    temperature: float = 1.0,
    token_chunk: int = 1024,
    head_dtype="float32",
):
    """(sum of loss_fn over token chunks, logprobs, entropy); gradients flow to hidden and W only.

    loss_fn(logprobs_Nc, entropy_Nc, inputs_chunk) -> scalar must be a sum of per-token terms
    that vanish where the inputs are zero (padding tokens get all-zero inputs); `inputs` is a
    pytree of arrays shaped like targets (treated as constants). loss_fn may close over arrays
    and tracers (e.g. a scheduled coefficient): they are hoisted out of its closure and passed
    through the custom VJP explicitly, and are treated as constants too. The returned logprobs
    and entropy are for metrics: they carry no gradient. Composes with jit, vmap, scan and
    checkpoint in any order.
    """
    N = math.prod(targets.shape)
    Nc = min(token_chunk, N)
    lp_Nc = jax.ShapeDtypeStruct((Nc,), jnp.float32)
    inp_Nc = jax.tree.map(lambda x: jax.ShapeDtypeStruct((Nc,), x.dtype), inputs)
    chunk_loss, consts = _closure_convert(loss_fn, lp_Nc, lp_Nc, inp_Nc)
    dtypes = (jnp.dtype(hidden_xE.dtype), jnp.dtype(w_ExV.dtype), jnp.dtype(head_dtype))
    loss, lp, ent = _fused(
        chunk_loss, temperature, Nc, dtypes, hidden_xE, w_ExV, targets, inputs, consts
    )
    return loss, jax.lax.stop_gradient(lp), jax.lax.stop_gradient(ent)
