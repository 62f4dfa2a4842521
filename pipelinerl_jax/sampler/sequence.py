"""What a request becomes inside the sampler: its sampling settings, one record per attempt,
and the prefill rows the scheduler hands the driver (no JAX in here).

Sequence lengths: a sequence of n tokens has K/V cached for its first n-1 tokens; token n-1 is
`last_token`, fed by the next decode step at position n-1.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # besides the sampler's EOS ids
    stop_strings: tuple[str, ...] = ()  # end a turn where its text holds one (module docstring)
    seed: int | None = None  # None: derived from (sampler seed, request id, attempt)

    def error(self) -> str | None:
        """A one-line reason why these params are invalid, or None."""
        if not self.temperature >= 0:
            return f"temperature={self.temperature} must be >= 0 (0 = greedy)"
        if self.top_k < 0:
            return f"top_k={self.top_k} must be >= 0 (0 = off)"
        if not 0 < self.top_p <= 1:
            return f"top_p={self.top_p} must be in (0, 1]"
        if self.max_new_tokens < 1:
            return f"max_new_tokens={self.max_new_tokens} must be >= 1"
        if isinstance(self.stop_strings, str) or any(
            not isinstance(s, str) or not s for s in self.stop_strings
        ):
            return (
                f"stop_strings={self.stop_strings!r} must be a tuple of non-empty strings: "
                "drop the empty ones"
            )
        return None


@dataclasses.dataclass(eq=False)
class Sequence:
    """One attempt of one request, from submission to retirement."""

    request_id: int
    attempt: int
    prompt: list[int]
    params: SamplingParams
    seed: int  # uint32 sampling seed of this attempt
    limit: int  # total length at which it stops ("length")
    stop_ids: tuple[int, ...]  # EOS + request stop ids
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    start_version: int | None = None
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)  # global ids
    admitted_at: int = -1  # admission counter (preemption picks the largest)
    preemptions: int = 0
    finish_reason: str | None = None
    keep: bool = False  # an episode: park between turns, keeping the pages (module docstring)
    shard: int | None = None  # the data shard its pages are in
    cached: int = 0  # parked or resumed: K/V positions its pages already hold
    turn_start: int = 0  # index in `tokens` where the current turn's generated tokens begin

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)


@dataclasses.dataclass
class PrefillRow:
    """Write K/V of tokens[start:] (at positions start..len-1) into the pages of `slot`'s block
    table; positions before `start` are already cached there (a resumed episode)."""

    slot: int
    tokens: list[int]
    start: int = 0
