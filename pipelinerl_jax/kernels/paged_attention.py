"""Paged decode attention: the one entry point, choosing the Triton kernel or the jnp reference.

On an NVIDIA GPU backend with jax-triton installed, `impl="auto"` launches the Triton kernel of
paged_attention_triton through `jax_triton.triton_call`, with the launch parameters from that
module's `launch_params` (the same function the interpreter tests and the sm_90 compile check
use). Everywhere else it runs the pure-jnp reference, which is also the production CPU path.
"On an NVIDIA GPU" means the program's target (kernels/target.py): a CPU process compiling
ahead of time for an H100 topology gets the Triton kernel in its program too.

Dimension letters (pipelinerl_jax/__init__.py):
B batch, H query heads, K kv heads, D head dim, P pages, S page size,
M pages per sequence (block-table width).

jax-triton is imported lazily, only on the GPU path: with Python 3.11 pip resolves jax-triton
0.3.x, whose import fails without a GPU and whose triton_call takes `out_shape=`; 0.4.x takes
`out_type=`. The call site below picks the keyword the installed version accepts.
"""

import functools
import inspect
import logging

import jax
import jax.numpy as jnp

from pipelinerl_jax.kernels import target
from pipelinerl_jax.kernels.paged_attention_ref import (
    PagedAttentionShapeError,
    check_paged_inputs,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)

__all__ = [
    "paged_decode_attention",
    "paged_prefill_attention",
    "triton_available",
    "PagedAttentionShapeError",
]

IMPLS = ("auto", "ref", "triton")


class PagedAttentionImplError(ValueError):
    """Raised when the requested implementation cannot run here."""


def paged_decode_attention(
    q_BxHxD, k_pages, v_pages, block_tables_BxM, lengths_B, *, scale, impl: str = "auto"
):
    """Decode attention of one query token per sequence over its paged KV cache.

    q_BxHxD: [B, H, D]; k_pages, v_pages: [P, K, S, D]; block_tables_BxM: int [B, M] page indices
    (entries past a sequence's pages may be anything); lengths_B: int [B] valid cached tokens
    (the current token's K/V already written). Returns [B, H, D] in q's dtype; f32 accumulation;
    a length of 0 gives zeros. impl: "auto" (Triton on an NVIDIA GPU with jax-triton, else
    "ref"), "ref", or "triton".
    """
    if impl not in IMPLS:
        raise PagedAttentionImplError(
            f"paged_decode_attention: impl={impl!r} is not one of {IMPLS}"
        )
    if impl == "auto":
        impl = "triton" if triton_available() else "ref"
    if impl == "ref":
        return paged_decode_attention_ref(
            q_BxHxD, k_pages, v_pages, block_tables_BxM, lengths_B, scale=scale
        )
    return _paged_decode_triton(q_BxHxD, k_pages, v_pages, block_tables_BxM, lengths_B, scale=scale)


def paged_prefill_attention(
    q_BxTxHxD, k_pages, v_pages, block_tables_BxM, q_positions_BxT, *, scale
):
    """Causal chunked prefill over the paged cache (the jnp reference on every backend)."""
    return paged_prefill_attention_ref(
        q_BxTxHxD, k_pages, v_pages, block_tables_BxM, q_positions_BxT, scale=scale
    )


def triton_available() -> bool:
    """True when the program being traced runs on an NVIDIA GPU with jax-triton: this process's
    GPU, or the ahead-of-time target of `target.compiling_for("gpu", ...)`."""
    aot = target.current()
    if aot is not None:
        return aot.platform == "gpu" and _jax_triton_imports()
    return _local_triton_available()


@functools.cache
def _local_triton_available() -> bool:
    """This process's answer (cached): an NVIDIA GPU backend and jax-triton importing."""
    if jax.default_backend() != "gpu":
        return False
    platform_version = getattr(jax.devices()[0].client, "platform_version", "").lower()
    if "cuda" not in platform_version:
        return False
    return _jax_triton_imports()


@functools.cache
def _jax_triton_imports() -> bool:
    try:
        import jax_triton  # noqa: F401  (only importable with a GPU on jax-triton 0.3.x)
    except ImportError as err:
        logging.warning(
            "paged attention: NVIDIA GPU targeted but jax_triton does not import (%s); "
            "using the jnp reference. Install the gpu extras for the Triton kernel.",
            err,
        )
        return False
    return True


def _paged_decode_triton(q_BxHxD, k_pages, v_pages, block_tables_BxM, lengths_B, *, scale):
    try:
        import jax_triton as jt
    except ImportError as err:
        raise PagedAttentionImplError(
            f"paged_decode_attention(impl='triton'): jax_triton does not import ({err}); install "
            "the gpu extras (pip install -e '.[gpu]') on an NVIDIA GPU machine, or use impl='ref'"
        ) from err
    # Deferred on purpose: the kernel module imports triton, an optional (gpu) dependency.
    from pipelinerl_jax.kernels import paged_attention_triton as pt

    if q_BxHxD.ndim != 3 or lengths_B.shape != (q_BxHxD.shape[0],):
        raise PagedAttentionShapeError(
            f"paged_decode_attention: q {tuple(q_BxHxD.shape)} must be [batch, heads, head_dim] "
            f"and lengths {tuple(lengths_B.shape)} [batch]"
        )
    check_paged_inputs(
        q_BxHxD.shape, k_pages, v_pages, block_tables_BxM, where="paged_decode_attention"
    )
    cache_dtype = jnp.dtype(k_pages.dtype)
    params = pt.contiguous_launch_params(
        q_BxHxD.shape,
        k_pages.shape,
        block_tables_BxM.shape,
        dtype=cache_dtype.name,
        scale=float(scale),
    )
    # The kernel's dots need q in the cache dtype; the output comes back in q's dtype.
    out_BxHxD = jt.triton_call(
        q_BxHxD.astype(cache_dtype),
        k_pages,
        v_pages,
        block_tables_BxM.astype(jnp.int32),
        lengths_B.astype(jnp.int32),
        kernel=pt.paged_decode_kernel,
        grid=params.grid,
        num_warps=params.num_warps,
        num_stages=params.num_stages,
        **{_out_keyword(jt.triton_call): jax.ShapeDtypeStruct(q_BxHxD.shape, cache_dtype)},
        **_compute_capability(jt.triton_call),
        **params.constexprs,
    )
    return out_BxHxD.astype(q_BxHxD.dtype)


def _compute_capability(triton_call) -> dict:
    """Ahead of time there is no device to ask its compute capability: pass the target's."""
    aot = target.current()
    if aot is None or aot.compute_capability is None:
        return {}
    if "compute_capability" not in inspect.signature(triton_call).parameters:
        raise PagedAttentionImplError(
            "paged_decode_attention: this jax-triton's triton_call takes no compute_capability, "
            "so the kernel cannot be compiled without a GPU; use jax-triton 0.3.1 or newer"
        )
    return {"compute_capability": aot.compute_capability}


def _out_keyword(triton_call) -> str:
    """'out_type' on jax-triton 0.4.x, 'out_shape' on 0.3.x."""
    return "out_type" if "out_type" in inspect.signature(triton_call).parameters else "out_shape"
