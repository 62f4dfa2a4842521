"""The environment protocol: what an episode's environment says before and after each turn.

An environment is stateless: `respond(problem, turns)` answers the model's latest turn given
all of the episode's model turns so far (text, as sampled: never re-tokenized by the
environment), so any worker process can answer any episode, and an episode in flight
survives a restart by replaying its turns. It returns a `Turn`: the next observation (a chat
message the pipeline appends through the tokenizer's chat template, raw text appended inside
the model's own message, or None when the episode is over; codec.py), this turn's reward
contribution, and whether the episode is done. The episode's reward is the sum.

A model turn ends at one of `stop_strings` (e.g. the end of a tool call), at EOS, or at the
token budget. `max_turns` bounds the episode: the turn that reaches it is the last, whatever
the environment says.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.errors import ConfigError

ROLES = ("user", "tool", "text")  # text: raw, inside the model's message (codec.py)
STATUSES = ("ok", "error", "timeout")


@dataclasses.dataclass(frozen=True)
class Turn:
    """The environment's answer to one model turn."""

    observation: dict | None  # {"role": "user" | "tool" | "text", "content": str}; None: done
    reward: float = 0.0  # this turn's contribution to the episode's reward
    done: bool = False
    status: str = "ok"  # "error" / "timeout": the environment failed; the episode ends
    info: dict = dataclasses.field(default_factory=dict)  # counts for metrics, e.g. tool_calls

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"turn status {self.status!r} is not one of {STATUSES}")


def failed_turn(status: str, detail: str) -> Turn:
    """An environment that hung, raised or answered garbage: the episode ends, reward 0."""
    return Turn(observation=None, reward=0.0, done=True, status=status, info={"detail": detail})


def as_turn(value: Any) -> Turn:
    """Checks what `respond` returned; a malformed answer raises (the runner makes it an
    error turn, so a buggy environment ends its episode, not the run)."""
    if not isinstance(value, Turn):
        raise TypeError(f"respond() returned {type(value).__name__}, not a Turn")
    if not isinstance(value.reward, (int, float)) or not math.isfinite(value.reward):
        raise ValueError(f"respond() returned a non-finite or non-numeric reward {value.reward!r}")
    if value.observation is None:
        if not value.done:
            raise ValueError("respond() returned no observation for an episode that goes on")
        return value
    obs = value.observation
    if not (
        isinstance(obs, dict)
        and obs.get("role") in ROLES
        and isinstance(obs.get("content"), str)
        and set(obs) == {"role", "content"}
    ):
        raise ValueError(
            f"respond() observation {obs!r} is not {{'role': {' | '.join(map(repr, ROLES))}, "
            "'content': str}"
        )
    return value


class Environment(abc.ABC):
    """Subclass with `first_messages` and `respond`; instances must pickle (they are sent to
    worker processes)."""

    name: str = "environment"
    max_turns: int = 1
    stop_strings: tuple[str, ...] = ()

    def __init__(self, *, max_turns: int | None = None):
        if max_turns is not None:
            self.max_turns = max_turns
        if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
            raise ConfigError(f"{self.name}: max_turns={self.max_turns!r} must be an int >= 1")

    @abc.abstractmethod
    def first_messages(self, problem: Problem) -> list[dict]:
        """The chat messages the episode starts from (the system prompt, the task)."""

    @abc.abstractmethod
    def respond(self, problem: Problem, turns: Sequence[str]) -> Turn:
        """The answer to turns[-1], the model's latest turn, given all of them."""

    def final(self, problem: Problem, turns: Sequence[str]) -> Turn:
        """`respond`, ended at max_turns: the last turn's reward counts, no observation."""
        turn = as_turn(self.respond(problem, turns))
        if len(turns) >= self.max_turns and not turn.done:
            return dataclasses.replace(turn, observation=None, done=True)
        return turn
