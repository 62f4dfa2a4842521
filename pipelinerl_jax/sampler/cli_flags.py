"""The sampler flags the command-line tools share (`generate`, `evaluate`): defined once, checked
before the model loads, and turned into the SamplerConfig of one job.

A job knows its prompts before it builds a sampler, so `--max_seq_len=0` sizes the context to
the longest prompt plus `max_new_tokens` (capped by the model), rounded up to whole pages.
"""

from __future__ import annotations

from absl import flags

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.sampler.config import SamplerConfig


def define(fv: flags.FlagValues, *, num_slots: int) -> None:
    """--num_slots (default `num_slots`), --max_seq_len, --page_size, --kv_memory_gb and
    --chunk_steps on `fv`."""
    flags.DEFINE_integer("num_slots", num_slots, "Sequences decoded at once.", flag_values=fv)
    flags.DEFINE_integer(
        "max_seq_len",
        0,
        "Context limit; 0 = the longest prompt + max_new_tokens (capped by the model).",
        flag_values=fv,
    )
    flags.DEFINE_integer("page_size", 16, "KV cache page size (tokens).", flag_values=fv)
    flags.DEFINE_float(
        "kv_memory_gb",
        0.0,
        "KV pool budget in GiB; 0 = room for every slot at max_seq_len.",
        flag_values=fv,
    )
    flags.DEFINE_integer("chunk_steps", 16, "Decode steps per jitted chunk.", flag_values=fv)


def check(fv: flags.FlagValues) -> None:
    """Raises a one-line ConfigError for a sampler flag out of range (before anything loads)."""
    for name in ("num_slots", "page_size", "chunk_steps"):
        if fv[name].value < 1:
            raise ConfigError(f"--{name}={fv[name].value} must be >= 1")
    if fv.max_seq_len < 0:
        raise ConfigError(
            f"--max_seq_len={fv.max_seq_len} must be >= 0 (0: the longest prompt + max_new_tokens)"
        )
    if fv.kv_memory_gb < 0:
        raise ConfigError(
            f"--kv_memory_gb={fv.kv_memory_gb} must be >= 0 (0: room for every slot at max_seq_len)"
        )


def sampler_config(
    fv: flags.FlagValues, *, longest_prompt: int, max_new_tokens: int, model_limit: int
) -> SamplerConfig:
    """The job's SamplerConfig from the flags, for prompts of at most `longest_prompt` tokens
    and a model of `model_limit` positions."""
    max_seq_len = fv.max_seq_len or min(model_limit, longest_prompt + max_new_tokens)
    max_seq_len = -(-max_seq_len // fv.page_size) * fv.page_size
    return SamplerConfig(
        num_slots=fv.num_slots,
        max_seq_len=max_seq_len,
        page_size=fv.page_size,
        kv_memory_bytes=int(fv.kv_memory_gb * 2**30) if fv.kv_memory_gb > 0 else None,
        chunk_steps=fv.chunk_steps,
        prefill_chunk=min(512, max_seq_len),
        seed=fv.seed,
    )
