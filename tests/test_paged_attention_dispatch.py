"""The public dispatcher: impl selection, the jax-triton call site, and launch-parameter errors.

The jax-triton call site is exercised on CPU with a stand-in `jax_triton` module that records
what the real triton_call would receive (0.3.x `out_shape=` and 0.4.x `out_type=` styles) and
answers with a value no other path produces: 1 - 2 x the reference attention of the very arrays
it was handed. The dispatcher's output must be exactly that, so a dispatch that fell back to the
reference, dropped the kernel's result, or passed q/k/v/tables/lengths in the wrong order or
with a wrong scale fails. On a GPU the real module is tested by test_paged_attention_gpu.py.
"""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.kernels import paged_attention as pa
from pipelinerl_jax.kernels import paged_attention_triton as pt
from pipelinerl_jax.kernels.paged_attention_ref import paged_decode_attention_ref


def _inputs(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), dtype)
    k = jnp.asarray(rng.standard_normal((10, 2, 16, 64)), dtype)  # [P, K, S, D]
    v = jnp.asarray(rng.standard_normal((10, 2, 16, 64)), dtype)
    tables = rng.permutation(10)[:9].reshape(3, 3)  # numpy int64: the call site casts
    lengths = np.asarray([5, 0, 48], np.int64)
    return q, k, v, tables, lengths


def test_auto_on_cpu_is_the_reference():
    args = _inputs()
    assert not pa.triton_available()
    want = jax.jit(paged_decode_attention_ref, static_argnames="scale")(*args, scale=0.125)
    for impl in ("auto", "ref"):
        got = jax.jit(lambda *a: pa.paged_decode_attention(*a, scale=0.125, impl=impl))(*args)
        np.testing.assert_array_equal(got, want)


def test_unknown_impl_is_rejected():
    with pytest.raises(pa.PagedAttentionImplError, match="impl='pallas'"):
        pa.paged_decode_attention(*_inputs(), scale=1.0, impl="pallas")


def test_triton_without_jax_triton_says_how_to_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # makes `import jax_triton` fail
    with pytest.raises(pa.PagedAttentionImplError, match="jax_triton does not import"):
        pa.paged_decode_attention(*_inputs(), scale=1.0, impl="triton")


def _fake_kernel_result(q, k, v, tables, lengths, *, scale, dtype):
    """What the stand-in kernel answers: distinct from the reference, a function of every input."""
    ref = paged_decode_attention_ref(q, k, v, tables, lengths, scale=scale)
    return (1.0 - 2.0 * ref.astype(jnp.float32)).astype(dtype)


def _fake_jax_triton(style, calls):
    """A jax_triton stand-in with the given triton_call keyword style that records each call."""

    def record(args, kwargs, out):
        calls.append(dict(args=args, kwargs=kwargs, out=out))
        return _fake_kernel_result(*args, scale=kwargs["SCALE_LOG2E"] / pt.LOG2E, dtype=out.dtype)

    if style == "0.3":

        def triton_call(
            *args,
            kernel,
            out_shape,
            grid,
            call_name="triton_kernel_call",
            num_warps=4,
            num_stages=2,
            **metaparams,
        ):
            return record(
                args,
                dict(
                    kernel=kernel,
                    grid=grid,
                    num_warps=num_warps,
                    num_stages=num_stages,
                    **metaparams,
                ),
                out_shape,
            )
    else:

        def triton_call(
            *args, kernel, out_type=None, grid, name="", num_warps=None, num_stages=None, **kwargs
        ):
            return record(
                args,
                dict(
                    kernel=kernel, grid=grid, num_warps=num_warps, num_stages=num_stages, **kwargs
                ),
                out_type,
            )

    return types.SimpleNamespace(triton_call=triton_call)


@pytest.mark.parametrize("style", ["0.3", "0.4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_triton_call_site_passes_the_shared_launch_params(monkeypatch, style, dtype):
    calls = []
    monkeypatch.setitem(sys.modules, "jax_triton", _fake_jax_triton(style, calls))
    q, k, v, tables, lengths = _inputs(dtype)
    out = jax.jit(lambda *a: pa.paged_decode_attention(*a, scale=0.125, impl="triton"))(
        q, k, v, tables, lengths
    )
    assert out.dtype == dtype and out.shape == q.shape
    # The kernel's answer comes through unchanged (same ops on the same inputs: exact) ...
    kernel = jax.jit(lambda *a: _fake_kernel_result(*a, scale=0.125, dtype=dtype))(
        q, k, v, jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32)
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(kernel, np.float32))
    # ... and is not the reference's (which a fallback to impl="ref" would give).
    ref = paged_decode_attention_ref(q, k, v, tables, lengths, scale=0.125)
    assert np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32)).max() > 0.5
    (call,) = calls
    want = pt.contiguous_launch_params(
        q.shape, k.shape, tables.shape, dtype=jnp.dtype(dtype).name, scale=0.125
    )
    kw = call["kwargs"]
    assert kw["kernel"] is pt.paged_decode_kernel
    assert kw["grid"] == want.grid == (3, 2, 1)
    assert (kw["num_warps"], kw["num_stages"]) == (want.num_warps, want.num_stages)
    assert {n: kw[n] for n in want.constexprs} == want.constexprs
    assert set(kw) == {"kernel", "grid", "num_warps", "num_stages", *want.constexprs}
    # Tables and lengths reach the kernel as int32, q in the cache dtype; output shaped like q.
    assert [a.dtype for a in call["args"]] == [jnp.dtype(dtype)] * 3 + [jnp.int32] * 2
    assert (call["out"].shape, call["out"].dtype) == (q.shape, jnp.dtype(dtype))


def test_launch_params_layouts_agree():
    """[P, S, K, D] and [P, K, S, D] describe the same cache through different strides."""
    common = dict(
        q_shape=(2, 8, 64),
        q_strides=(512, 64, 1),
        block_tables_shape=(2, 4),
        block_tables_strides=(4, 1),
        out_strides=(512, 64, 1),
        dtype="bfloat16",
        scale=0.125,
    )
    pskd = pt.launch_params(cache_shape=(9, 16, 2, 64), cache_strides=(2048, 128, 64, 1), **common)
    pksd = pt.launch_params(
        cache_shape=(9, 2, 16, 64), cache_strides=(2048, 1024, 64, 1), cache_layout="PKSD", **common
    )
    assert pskd.grid == pksd.grid == (2, 2, 1)
    assert (pskd.constexprs["KV_SS"], pskd.constexprs["KV_SK"]) == (128, 64)
    assert (pksd.constexprs["KV_SS"], pksd.constexprs["KV_SK"]) == (64, 1024)
    assert pskd.constexprs["GP"] == 16 and pskd.constexprs["G"] == 4
    assert not pskd.constexprs["UPCAST_DOTS"] and not pskd.constexprs["IEEE_DOT"]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(dtype="int8"), "dtype int8"),
        (dict(cache_shape=(9, 8, 2, 64), cache_strides=(1024, 128, 64, 1)), "multiple of 16"),
        (
            dict(
                q_shape=(2, 8, 48),
                q_strides=(384, 48, 1),
                out_strides=(384, 48, 1),
                cache_shape=(9, 16, 2, 48),
                cache_strides=(1536, 96, 48, 1),
            ),
            "power of two",
        ),
        (dict(q_shape=(2, 6, 64)), "does not fit"),
        (dict(cache_layout="KPSD"), "cache_layout"),
        (dict(cache_strides=(4096, 256, 128, 2)), "contiguous"),
    ],
)
def test_launch_params_rejects_unsupported(change, match):
    args = dict(
        q_shape=(2, 8, 64),
        q_strides=(512, 64, 1),
        cache_shape=(9, 16, 4, 64),
        cache_strides=(4096, 256, 64, 1),
        block_tables_shape=(2, 4),
        block_tables_strides=(4, 1),
        out_strides=(512, 64, 1),
        dtype="float32",
        scale=0.125,
    )
    args.update(change)
    with pytest.raises(pt.PagedKernelConfigError, match=match):
        pt.launch_params(**args)
