"""Decode attention strategies: one small object per way a decode step reads and writes the pool.

`steps.decode_chunk` runs its k steps in one `lax.scan` and never asks which strategy it has:

    carry = strategy.init_carry(state, block_tables_BxM, window)    # once per chunk
    each step:
        attend = strategy.attend(block_tables_BxM, positions_B, active_B, window, scale)
        hidden, carry = forward.forward_hidden(..., attend, carry, layout=strategy.layout)
    state = strategy.finish(state, carry)                           # the pool back in state

While the chunk runs the carry owns the page pool (state.k_pages / v_pages are None inside the
scan, so the pool is carried once). Besides the three methods a strategy names
- `layout`: the activation layout the model runs in (forward.py; `engine.prepare_params`
  converts the weights to it once per version);
- `scatter`: how prefill and page copies write the pool (attend.plain_set or attend.set_at).

`pick` chooses one per backend from `EngineConfig.attention`:
- "paged" (`PagedAttention`, what "auto" picks where the Triton kernel runs): plain JAX, the
  model's token-major block, `.at[].set` writes, `kernels.paged_decode_attention`.
- "staged" (`StagedAttention`, what "auto" picks elsewhere: the CPU path): the feature-major
  block, a dense copy of the window per chunk, 16-bit pools stored as bit patterns.
- "gather" (`GatherAttention`): the feature-major block, each step gathers the window and
  merges the new token itself (attend.decode_attend).
All three compute the same attention (tests/test_sampler_strategies.py decodes with each and
compares tokens and logprobs); they differ in how memory is laid out and touched.

Dimension letters (pipelinerl_jax/__init__.py):
B slots, M pages per slot, W window pages, L layers, P pages per layer,
K kv heads, S page size, D head dim, N = W * S.
"""

from __future__ import annotations

import abc
import dataclasses

import jax.numpy as jnp

from pipelinerl_jax.kernels.paged_attention import triton_available
from pipelinerl_jax.sampler import attend as attn
from pipelinerl_jax.sampler import staged
from pipelinerl_jax.sampler.config import ATTENTION_IMPLS

# Why the CPU strategies run the feature-major block (activations [E, N], projections [O, I];
# the code is models/block.py's FeatureMajor, run by forward.py): XLA:CPU's matmul (YNNPACK)
# splits work over the rows of the left operand, so token-major [N, E] @ [E, O] products at
# decode batches (N = 8-64 rows) ran on one core (docs/cpu_measurements.md#feature-major-layout).
# The layout brings its own CPU measures (an optimization_barrier keeping the q/k/v transposes
# out of their matmuls, one 16-bit token in its own form), explained in models/block.py.
# None of these was measured on a GPU, so the GPU strategy runs the model's plain token-major
# block instead.
CPU_LAYOUT = "feature_major"
PLAIN_LAYOUT = "token_major"


@dataclasses.dataclass(frozen=True)
class DecodeAttention(abc.ABC):
    """Base: the pool itself is the carry (as it is for "paged" and "gather")."""

    cache_dtype: str = "float32"  # the values the pool holds (`pool_dtype`: how it stores them)

    name = ""
    layout = ""
    scatter = staticmethod(attn.plain_set)

    @property
    def pool_dtype(self):
        """The dtype of state.k_pages / v_pages (steps.empty_state makes the pool in it): a
        strategy that writes with `attend.set_at` stores a 16-bit pool as its uint16 bits, the
        bits set_at scatters (a view made per call would be a copy of the whole pool)."""
        return attn.pool_dtype(self.cache_dtype, as_bits=self.scatter is attn.set_at)

    def init_carry(self, state, block_tables_BxM, window: int):
        """Once per chunk, before the scan: what the forward threads through its layers."""
        del block_tables_BxM, window
        return (state.k_pages, state.v_pages)

    @abc.abstractmethod
    def attend(self, block_tables_BxM, positions_B, active_B, window: int, scale: float):
        """One step's attend(q, k, v, (layer, carry)) -> (out, (layer, carry)): attends the
        token at positions_B over the row's first `window` pages and itself, and writes its
        K/V (rows with active False write to the null page)."""

    def finish(self, state, carry):
        """After the scan: the pool back into state."""
        k_pages, v_pages = carry
        return state.replace(k_pages=k_pages, v_pages=v_pages)


@dataclasses.dataclass(frozen=True)
class PagedAttention(DecodeAttention):
    """The GPU path: plain JAX around `kernels.paged_decode_attention` (the Triton kernel on
    NVIDIA GPUs; its jnp reference elsewhere, or always with impl="ref").

    Each layer writes the token's K/V into the pool with a plain `.at[].set` in the pool's
    dtype, then the kernel reads the pages in place. Layout: the model's token-major block.
    """

    impl: str = "auto"  # kernels.paged_decode_attention: "auto" | "ref" | "triton"

    name = "paged"
    layout = PLAIN_LAYOUT
    scatter = staticmethod(attn.plain_set)

    def attend(self, block_tables_BxM, positions_B, active_B, window: int, scale: float):
        return attn.decode_attend_paged(
            block_tables_BxM,
            positions_B,
            active_B,
            window,
            scale=scale,
            impl=self.impl,
            scatter=attn.plain_set,
        )


@dataclasses.dataclass(frozen=True)
class StagedAttention(DecodeAttention):
    """The CPU path: each row's window copied once per chunk into dense per-layer arrays laid
    out for the two attention dots (staged.py); every step writes its token into them and into
    the pool, so the pool stays the one source of truth.

    Why: on CPU a paged gather is a full copy of the window per step and layer (XLA:CPU has no
    fused gather-matmul), so copying the window once per chunk instead pays off
    (docs/cpu_measurements.md#decode-attention-strategies). Cost: the window exists twice
    while the chunk runs (pipeline/memory.py counts it).
    """

    name = "staged"
    layout = CPU_LAYOUT
    # With set_at, 16-bit pools (and so their stages) are stored as their uint16 bit patterns
    # (`pool_dtype`), so each step's writes are integer scatters in place with no conversion
    # copies: XLA:CPU has no bf16 scatter and otherwise upcasts the whole pool to f32 and back
    # per write, most of a bf16 decode step, and a view of the pool as bits made per chunk is
    # itself a copy of the pool on entry and on exit
    # (docs/cpu_measurements.md#16-bit-pools-as-bits).
    scatter = staticmethod(attn.set_at)

    def init_carry(self, state, block_tables_BxM, window: int):
        if state.k_pages.dtype != self.pool_dtype:
            raise ValueError(
                f"staged attention: the pool is {state.k_pages.dtype}, the engine's "
                f"cache_dtype {self.cache_dtype} is stored as {self.pool_dtype}"
            )
        # K/V are cached for positions < lengths - 1 (the last token's come this step).
        k_stage, v_stage = staged.stage(
            state.k_pages, state.v_pages, block_tables_BxM[:, :window], state.lengths - 1
        )
        return (state.k_pages, state.v_pages, k_stage, v_stage)

    def attend(self, block_tables_BxM, positions_B, active_B, window: int, scale: float):
        del window  # the stage already holds the window
        return staged.decode_attend_staged(
            block_tables_BxM, positions_B, active_B, scale=scale, cache_dtype=self.cache_dtype
        )

    def finish(self, state, carry):
        k_pages, v_pages = carry[:2]  # the stage is dropped
        return state.replace(k_pages=k_pages, v_pages=v_pages)


@dataclasses.dataclass(frozen=True)
class GatherAttention(DecodeAttention):
    """Each step and layer gathers the row's window from the pool, merges the new token into
    the same f32 softmax (attend.decode_attend), then writes its K/V. A CPU strategy: the
    feature-major block, 16-bit pools stored as bit patterns (attend.set_at)."""

    name = "gather"
    layout = CPU_LAYOUT
    scatter = staticmethod(attn.set_at)

    def attend(self, block_tables_BxM, positions_B, active_B, window: int, scale: float):
        return attn.decode_attend(
            block_tables_BxM,
            positions_B,
            active_B,
            window,
            scale=scale,
            scatter=attn.set_at,
            cache_dtype=self.cache_dtype,
        )


STRATEGIES = {"staged": StagedAttention, "paged": PagedAttention, "gather": GatherAttention}
assert ATTENTION_IMPLS == ("auto", *STRATEGIES), "sampler/config.py names the strategies"


def resolve(attention: str) -> str:
    """The strategy name an attention option means: "auto" is "paged" where the Triton kernel
    runs (an NVIDIA GPU with jax-triton), else "staged"; other valid names stay as they are."""
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTION_IMPLS}")
    if attention == "auto":
        return "paged" if triton_available() else "staged"
    return attention


def pick(attention: str, cache_dtype: str = "float32") -> DecodeAttention:
    """The strategy for an `EngineConfig.attention` value (hashable: a jit static is fine)."""
    return STRATEGIES[resolve(attention)](cache_dtype=jnp.dtype(cache_dtype).name)
