"""x @ w on 16-bit operands with f32 accumulation, in the forward pass and in the backward.

Mixed precision as torch autocast does it: both operands are rounded to the compute dtype
(bf16), products accumulate in f32, and the result is rounded to the dtype asked for. The
backward keeps that form: the incoming cotangent is rounded to the compute dtype and both
gradient matmuls take 16-bit operands with f32 accumulation.

Why a custom VJP: JAX transposes dot(x_bf16, w_bf16, preferred_element_type=f32) into dots of
the f32 cotangent with a bf16 operand, and XLA runs a mixed f32 x bf16 dot as an f32 matmul.
For a model projection the cotangent arrives as the cotangent of a bf16 result, so rounding it
to bf16 again loses nothing: the gradients are those plain autodiff computes, up to summation
order, from matmuls that take the fast 16-bit path (on a Xeon, AMX).

Why `lhs_transposed` on CPU: XLA:CPU hands a bf16 dot to its fast matmul library only when the
left operand's contracted dimension is the minor one in memory; any other dot is upcast to f32
(XLA's operand upcaster). The weight gradient x^T @ g contracts the token axis, the leading
axis of both operands, and a plain transpose is only a layout change, so XLA would upcast it.
Two transposed halves concatenated are a real copy in the default layout, and the dot stays
bf16; the copy is of the activations only ([N, I], small beside the matmul), and it moves
their bits as uint16, since XLA:CPU moves bf16 values through f32. Other backends take the
plain transpose.

Letters (pipelinerl_jax/__init__.py): N rows (tokens), I input features, O output features.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pipelinerl_jax.kernels import target

# The operand dtypes an LM head may run on (f32 accumulation for the 16-bit ones): the trainer's
# loss.head_dtype and the sampler's head_dtype accept these.
HEAD_DTYPES = ("float32", "bfloat16", "float16")

_F32 = jnp.float32
# jax 0.11's XLA:CPU splits a dot over a concatenated operand into one dot per half, each
# reading its half transposed again (undoing the physical transpose), and its DotThunk then
# fails on bf16 x bf16 -> f32 where the other operand is a constant. The barrier keeps the
# concatenation whole; jax 0.10's XLA keeps it whole by itself.
_SPLITS_CONCAT_DOTS = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 11)


def lhs_transposed(x_NxI: jax.Array, *, as_bits: bool = True) -> jax.Array:
    """x^T [I, N] as a left matmul operand the backend's 16-bit matmul accepts (module doc).
    `as_bits=False` copies 16-bit values as values, the slower form (bench_gemm.py times it)."""
    N = x_NxI.shape[0]
    if target.platform() != "cpu" or N < 2:
        return x_NxI.T
    half = N // 2
    # XLA:CPU runs a bf16 transpose and concatenate through f32 (upcast, move, round back);
    # as uint16 the same bits move once (bench_gemm.py's `copy` against `copy_values`).
    bits = as_bits and x_NxI.dtype.itemsize == 2 and jnp.issubdtype(x_NxI.dtype, jnp.floating)
    u_NxI = jax.lax.bitcast_convert_type(x_NxI, jnp.uint16) if bits else x_NxI
    u_IxN = jnp.concatenate([u_NxI[:half].T, u_NxI[half:].T], axis=1)
    if _SPLITS_CONCAT_DOTS:
        u_IxN = jax.lax.optimization_barrier(u_IxN)
    return jax.lax.bitcast_convert_type(u_IxN, x_NxI.dtype) if bits else u_IxN


def _dot(a, b, contract_a: int, contract_b: int) -> jax.Array:
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=_F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _mixed(x_NxI, w_IxO, compute_dtype, out_dtype, x_dtype, w_dtype):
    return _dot(x_NxI.astype(compute_dtype), w_IxO.astype(compute_dtype), 1, 0).astype(out_dtype)


def _mixed_fwd(x_NxI, w_IxO, compute_dtype, out_dtype, x_dtype, w_dtype):
    xc_NxI, wc_IxO = x_NxI.astype(compute_dtype), w_IxO.astype(compute_dtype)
    return _dot(xc_NxI, wc_IxO, 1, 0).astype(out_dtype), (xc_NxI, wc_IxO)


def _mixed_bwd(compute_dtype, out_dtype, x_dtype, w_dtype, res, g_NxO):
    xc_NxI, wc_IxO = res
    gc_NxO = g_NxO.astype(compute_dtype)
    dx_NxI = _dot(gc_NxO, wc_IxO, 1, 1)  # g @ w^T: the right operand's contraction is minor
    dw_IxO = _dot(lhs_transposed(xc_NxI), gc_NxO, 1, 0)
    return dx_NxI.astype(x_dtype), dw_IxO.astype(w_dtype)


_mixed.defvjp(_mixed_fwd, _mixed_bwd)


def mixed_matmul(x_NxI: jax.Array, w_IxO: jax.Array, compute_dtype, out_dtype=None) -> jax.Array:
    """[N, I] @ [I, O] with operands rounded to `compute_dtype`, accumulated in f32, returned as
    `out_dtype` (default: x's dtype). Gradients come back in x's and w's own dtypes. Composes
    with jit, grad, vmap, scan and checkpoint (every array is an explicit argument)."""
    out_dtype = jnp.dtype(out_dtype or x_NxI.dtype)
    return _mixed(
        x_NxI,
        w_IxO,
        jnp.dtype(compute_dtype),
        out_dtype,
        jnp.dtype(x_NxI.dtype),
        jnp.dtype(w_IxO.dtype),
    )
