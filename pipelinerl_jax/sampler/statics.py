"""What a compiled sampler engine depends on, besides the model: its static shapes
(`EngineConfig`), the mesh axes its steps run under (`MeshAxes`), the decode window's buckets,
the decode attention strategy those shapes pick, and the `ModelApply` hook for a model of your
own. All hashable: the device steps (steps.py) take them as jit statics.

Dimension letters (pipelinerl_jax/__init__.py):
B slots, S page size, P pages, M pages per slot, W window pages, X stop tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from pipelinerl_jax.sampler import strategies


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shapes of the engine (hashable)."""

    num_slots: int  # B
    page_size: int  # S
    num_pages: int  # P per layer, including the null page
    pages_per_slot: int  # M
    max_stop_tokens: int  # X
    cache_dtype: str = "float32"
    head_dtype: str = "float32"  # the LM head's matmul operands (forward.decode_params)
    truncated_logprobs: bool = False  # see sampling.py: default records tempered logprobs
    attention: str = "auto"  # decode attention strategy (strategies.py): "paged" runs the
    #   model's token-major block, writes the step's K/V with .at[].set
    #   and calls kernels.paged_decode_attention (the Triton kernel on
    #   NVIDIA GPUs, its jnp reference elsewhere); "staged" (the CPU
    #   path) runs the feature-major block, writes the pool too but
    #   reads a dense copy of the window made once per chunk
    #   (staged.py); "gather" runs the feature-major block and merges
    #   the new token with the gathered pages itself
    #   (attend.decode_attend); "auto": "paged" where the Triton kernel
    #   runs, else "staged" (faster on CPU:
    #   docs/cpu_measurements.md#decode-attention-strategies).


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The mesh axes a free function runs under (inside the Engine's shard_map). The default,
    no axes, is one device: global page ids are local ones and nothing is communicated."""

    data: str | None = None  # slots and pages split over it (block tables hold global ids)
    tp: str | None = None  # params Megatron-split over it: partial outputs psum'ed per layer
    gather_logits: bool = False  # the LM head is split by vocabulary over tp


ONE_DEVICE = MeshAxes()


def window_buckets(max_pages: int) -> tuple[int, ...]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... (powers of 2 and 1.5x) capped at max_pages."""
    out, p = set(), 1
    while p < max_pages:
        out.update({p, p + p // 2} if p >= 2 else {p})
        p *= 2
    out.add(max_pages)
    return tuple(sorted(b for b in out if b <= max_pages))


def pick_window(needed_pages: int, max_pages: int) -> int:
    """Smallest bucket >= needed_pages (>= 1)."""
    needed_pages = max(1, min(needed_pages, max_pages))
    return next(b for b in window_buckets(max_pages) if b >= needed_pages)


def strategy_of(ecfg: EngineConfig) -> strategies.DecodeAttention:
    return strategies.pick(ecfg.attention, ecfg.cache_dtype)


def pool_dtype(ecfg: EngineConfig):
    """The dtype the engine stores its page pool in: cache_dtype, or a 16-bit cache as its
    uint16 bits on the CPU strategies (`attend.pool_dtype`; `attend.float_view` reads it)."""
    return strategy_of(ecfg).pool_dtype


# Your own model, decoded over the paged cache (decode_chunk / prefill / state_from_prompts with
# `apply=`): apply(params, tokens_BxT, positions_BxT, attend, carry) -> (logits_BxTxV, carry).
# Layer l (a Python int, 0..L-1) attends through the engine instead of over its own keys:
#     out_BxTxHxD, (l, carry) = attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, (l, carry))
# with q and k already position-encoded (RoPE, if the model uses it), scaled by 1/sqrt(D)
# inside; attend caches k and v and returns the attention output before the output
# projection. The carry (the page pool, or the strategy's staged copies) is opaque: thread it
# through the layers in order and return it.
ModelApply = Callable[..., tuple[jax.Array, object]]
