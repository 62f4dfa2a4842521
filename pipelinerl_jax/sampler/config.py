"""SamplerConfig: one sampler's sizes and policies (light: importing it builds no sampler)."""

from __future__ import annotations

import dataclasses

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models.mixed_matmul import HEAD_DTYPES

# Decode attention strategies (sampler/strategies.py checks its table against these names).
ATTENTION_IMPLS = ("auto", "staged", "paged", "gather")
KV_POLICIES = ("keep", "recompute")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def width_ladder(slots: int, widths: int) -> list[int]:
    """The decode widths `slots` offers, widest first: `slots` and up to `widths` - 1 exact
    halvings of it (a width must divide evenly into the slots it narrows)."""
    ladder = [slots]
    while len(ladder) < widths and ladder[-1] % 2 == 0:
        ladder.append(ladder[-1] // 2)
    return ladder


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Sizes and policies of one sampler. Size the pool with num_pages or kv_memory_bytes;
    with neither, every slot gets room for max_seq_len tokens."""

    num_slots: int = 8  # sequences decoded at once (per sampler)
    max_seq_len: int = 2048  # prompt + completion tokens a slot can hold
    page_size: int = 16  # tokens per KV cache page
    num_pages: int | None = None  # including one null page per data shard
    kv_memory_bytes: int | None = None  # or size the KV pool by bytes
    chunk_steps: int = 16  # decode steps per jitted chunk
    prefill_chunk: int = 512  # longest prefill piece (tokens); multiple of page_size
    max_prefill_rows: int = 16  # prefill rows per call and shard
    prefill_pad_tokens: bool = False  # pad every prefill piece to prefill_chunk tokens: one
    #   compiled shape per power-of-two row count, all
    #   compiled by warm_up(), so none compiles mid-run
    max_stop_tokens: int = 8  # EOS + stop ids per request
    kv_policy: str = "keep"  # "keep" | "recompute"
    compute_dtype: str | None = None  # decode's weights and activations; default: the
    #   model's. "bfloat16" under an f32 trainer halves what
    #   each decode step reads; the logprob mismatch it adds
    #   is measured (mismatch/*) and corrected by the ratio
    cache_dtype: str | None = None  # default: the sampler's compute dtype
    head_dtype: str | None = None  # the LM head's matmul operands: "float32", or
    #   "bfloat16" / "float16" accumulated in f32 (logits stay
    #   f32); default float32, and in a run the trainer's
    #   loss.head_dtype, so behaviour and trainer logprobs
    #   share one head
    truncated_logprobs: bool = False  # record logprobs of the top-k/top-p truncated
    #   distribution, not the tempered one (sampling.py)
    seed: int = 0  # sampling seed (a run adds its own seed)
    data_axis: str = "data"  # mesh axis the slots are split over
    tp_axis: str = "tp"  # mesh axis params / kv heads are split over (if any)
    min_window_pages: int = 1  # attention reads >= this many pages per slot; set it
    #   to max_seq_len / page_size for a single compile
    attention: str = "auto"  # decode attention: "auto" | "staged" | "paged" |
    #   "gather" (steps.EngineConfig says which is which)
    decode_widths: int = 1  # batch widths decode may run at: 1 runs every slot each
    #   step; n > 1 packs running sequences into the lowest
    #   slots and runs the narrowest of B, B/2, ... B/2^(n-1)
    #   slots (per data shard) that holds them: a half-empty
    #   batch costs less, at up to n compiles per window

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raises a one-line ConfigError naming the first bad field (at construction, so before
        anything is built)."""
        if self.kv_policy not in KV_POLICIES:
            raise ConfigError(f"kv_policy={self.kv_policy!r}: use one of {KV_POLICIES}")
        if self.compute_dtype not in (None, *COMPUTE_DTYPES):
            raise ConfigError(
                f"sampler compute_dtype={self.compute_dtype!r}: use one of {COMPUTE_DTYPES}"
            )
        if self.cache_dtype not in (None, *COMPUTE_DTYPES):
            raise ConfigError(
                f"sampler cache_dtype={self.cache_dtype!r}: use one of {COMPUTE_DTYPES}"
            )
        if self.head_dtype not in (None, *HEAD_DTYPES):
            raise ConfigError(f"sampler head_dtype={self.head_dtype!r}: use one of {HEAD_DTYPES}")
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError(f"sampler attention={self.attention!r}: use one of {ATTENTION_IMPLS}")
        for name in ("page_size", "max_prefill_rows", "max_stop_tokens", "min_window_pages"):
            if getattr(self, name) < 1:
                raise ConfigError(f"sampler.{name}={getattr(self, name)} must be >= 1")
        if self.prefill_chunk % self.page_size or self.prefill_chunk < self.page_size:
            raise ConfigError(
                f"prefill_chunk={self.prefill_chunk} must be a positive multiple "
                f"of page_size={self.page_size}"
            )
        if self.decode_widths < 1:
            raise ConfigError(
                f"decode_widths={self.decode_widths}: use 1 (every slot, every step) or more"
            )
        if self.num_slots < 1 or self.chunk_steps < 1 or self.max_seq_len < 2:
            raise ConfigError(
                f"num_slots={self.num_slots}, chunk_steps={self.chunk_steps} must "
                f"be >= 1 and max_seq_len={self.max_seq_len} >= 2"
            )
        self.check_shards(1)

    def check_shards(self, shards: int) -> None:
        """Raises a one-line ConfigError when the slots do not split over `shards` data shards
        (the sampler mesh's data axis), or a shard's slots do not halve into `decode_widths`
        widths."""
        if self.num_slots % shards:
            raise ConfigError(
                f"num_slots={self.num_slots} must divide by the sampler's {shards} data shards "
                "(sampler devices / devices.sampler_tp): change it or devices.sampler"
            )
        per_shard = self.num_slots // shards
        ladder = width_ladder(per_shard, self.decode_widths)
        if len(ladder) < self.decode_widths:
            where = f"num_slots={self.num_slots}" + (
                f" over {shards} data shards ({per_shard} each)" if shards > 1 else ""
            )
            raise ConfigError(
                f"decode_widths={self.decode_widths}: {where} halves into {len(ladder)} widths "
                f"{tuple(ladder)}; use decode_widths <= {len(ladder)} or a num_slots with more "
                "factors of 2"
            )
