"""Checks of what callers hand PagedSampler: a request (`submit`) and an episode's next turn
(`resume`). Each returns a one-line reason naming what is wrong and how to fix it, or None;
the sampler turns a reason into error samples instead of raising, so one bad request never
stops the others.
"""

from __future__ import annotations

from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.sequence import SamplingParams


def request_error(
    prompt: list[int],
    params: SamplingParams,
    stop_ids: tuple[int, ...],
    *,
    config: SamplerConfig,
    vocab_size: int,
    capacity_tokens: int,
    can_detokenize: bool,
) -> str | None:
    """Why a submitted prompt with these params cannot be served, or None."""
    if not prompt:
        return "empty prompt: give at least one token"
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} outside the vocabulary [0, {vocab_size})"
    if len(prompt) >= config.max_seq_len:
        return (
            f"prompt of {len(prompt)} tokens leaves no room under max_seq_len="
            f"{config.max_seq_len}: shorten it or raise max_seq_len"
        )
    if len(prompt) > capacity_tokens:
        return (
            f"prompt of {len(prompt)} tokens exceeds what the KV pool can ever hold "
            f"({capacity_tokens} tokens): raise num_pages"
        )
    if len(stop_ids) > config.max_stop_tokens:
        return (
            f"{len(stop_ids)} stop/EOS ids exceed max_stop_tokens="
            f"{config.max_stop_tokens}: raise it"
        )
    error = params.error()
    if error is None and params.stop_strings and not can_detokenize:
        return (
            "stop_strings need the sampler to read text: build it with "
            "PagedSampler(..., detokenize=lambda ids: tokenizer.decode(ids))"
        )
    return error


def observation_error(
    length: int, tokens: list[int], max_new_tokens: int, *, vocab_size: int, cap: int
) -> str | None:
    """Why an episode of `length` tokens cannot take observation `tokens` and then decode
    `max_new_tokens` more under `cap` tokens (max_seq_len, the KV pool), or None."""
    if not tokens:
        return "empty observation: give at least one token"
    if any(not 0 <= t < vocab_size for t in tokens):
        return f"observation token outside the vocabulary [0, {vocab_size})"
    if max_new_tokens < 1:
        return f"max_new_tokens={max_new_tokens} must be >= 1"
    if length + len(tokens) >= cap:
        return (
            f"episode of {length + len(tokens)} tokens leaves no room under "
            f"max_seq_len/the KV pool ({cap} tokens)"
        )
    return None
