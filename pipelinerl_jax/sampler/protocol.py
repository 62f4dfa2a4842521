"""The Sampler protocol: everything the pipeline asks of a sampler, and the Sample it returns.

The Coordinator (pipeline/coordinator.py) and the weight Publisher (pipeline/weights.py) use a
sampler through these members only, so any object that has them can generate for a run:
`PagedSampler` (sampler.py, continuous batching over a paged KV cache on this process's
devices), a test double, or a sampler in another process behind a host-level proxy. Nothing in
the protocol names a device, a mesh or a model: requests go in as token ids, finished attempts
come back as `Sample`s, and params go in as whatever the trainer produces.

    sampler.submit(prompt_ids, n=4, params=SamplingParams(max_new_tokens=64), request_id=7)
    while sampler.has_work():
        for sample in sampler.step():       # one chunk of decoding; finished attempts return
            ...
    sampler.set_params(sampler.prepare(new_params), version=1, prepared=True)

Threads: the Coordinator calls `submit`, `has_work` and `step` from its sampler thread only;
`prepare` and `set_params` may come from any thread (the Publisher calls `prepare` in the
trainer thread); `version` and `num_slots` are read from both.

Versions: every generated token is tagged with the policy version that produced it. Params
handed to `set_params` take effect at the next `step()` (a chunk boundary): tokens decoded by
that step and later carry the new version, tokens decoded before keep the old one, so one
attempt may mix versions (the in-flight update). The lag bound (pipeline/admission.py) relies
on this tagging being exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from pipelinerl_jax.sampler.sequence import SamplingParams


@dataclasses.dataclass
class Sample:
    """One finished attempt, as `Sampler.step()` returns it."""

    request_id: int  # the id submit() returned (or was given)
    attempt: int  # 0 .. n-1 within its request
    prompt_ids: list[int]
    token_ids: list[int]  # the completion, the final stop token included if one was sampled
    #   (with stop strings: up to the token that completed one, nothing after it)
    logprobs: list[float]  # behaviour logprob of each completion token, f32 values
    versions: list[int]  # policy version that produced each completion token
    start_version: int | None  # version when the attempt was first admitted
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None  # finish_reason "error": a one-line reason (a bad request)
    preemptions: int = 0  # times the attempt was evicted and later resumed


@runtime_checkable
class Sampler(Protocol):
    """What the pipeline needs of a sampler (see the module docstring for threads and versions).

    `isinstance(x, Sampler)` checks that the members exist, not their signatures."""

    @property
    def version(self) -> int:
        """The policy version the sampler decodes with now: that of the params last swapped
        in by `step()`. Params staged by `set_params` but not yet swapped do not count; the
        Coordinator tracks those itself (Coordinator.hand_params)."""
        ...

    @property
    def num_slots(self) -> int:
        """How many attempts decode at once. The Coordinator keeps about this many attempts
        (plus one group) submitted, so a finished attempt's slot is refilled at once."""
        ...

    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        n: int = 1,
        params: SamplingParams = SamplingParams(),
        request_id: int | None = None,
    ) -> int:
        """Queues `n` attempts of one prompt and returns the request id (`request_id` when
        given; the Coordinator passes its group index). Never blocks on generation. A request
        the sampler cannot serve (empty prompt, token outside the vocabulary, too long) comes
        back from a later `step()` as `n` samples with finish_reason "error", not as an
        exception; n outside [1, num_slots] may raise ConfigError. `params.stop_strings` end
        an attempt at the first token whose text completes one; a sampler that cannot read
        text (PagedSampler built without `detokenize`) returns such requests as errors."""
        ...

    def has_work(self) -> bool:
        """True while some submitted attempt has not been returned by `step()` yet."""
        ...

    def step(self) -> list[Sample]:
        """Swaps in params staged by `set_params`, runs one bounded chunk of decoding and
        returns the attempts that finished (possibly none). Each submitted attempt is returned
        exactly once. The Coordinator's sampler thread calls it in a loop, taking new weights
        between calls, so one call should take about as long as a decode chunk, not a whole
        generation."""
        ...

    def prepare(self, params: Any) -> Any:
        """The trainer's params (a model params pytree) in whatever form `set_params(...,
        prepared=True)` takes: for PagedSampler, copied to its devices and converted to its
        decode layout. Must not alias `params` (the trainer donates them to its next step)
        and should not wait for the copy: the Publisher calls it in the trainer thread right
        after each step, so the sampler's chunk boundary only swaps a reference."""
        ...

    def set_params(self, params: Any, version: int, *, prepared: bool = False) -> None:
        """Stages new params for the next `step()`, from any thread; a later call replaces
        params staged and not yet swapped. `prepared=True`: `params` came from `prepare`;
        else they are the trainer's params and are prepared here."""
        ...
