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
from pipelinerl_jax.errors import ConfigError, did_you_mean

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


# Checks of an environment's options, each a one-line ConfigError naming the environment, the
# option, the value and what it must be; each returns the value (a float for a number).


def _refuse(env: str, option: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"environment {env}: option {option}={value!r} must be {expected}")


def check_int(env: str, option: str, value: Any, *, lo: int | None = None) -> int:
    """An int (not a bool), at least `lo` when given."""
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
        raise _refuse(env, option, value, "an int" + (f" >= {lo}" if lo is not None else ""))
    return value


def check_number(
    env: str, option: str, value: Any, *, lo: float | None = None, hi: float | None = None
) -> float:
    """A finite int or float (not a bool) in [lo, hi] (each bound when given)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = (
            f" in [{lo:g}, {hi:g}]"
            if lo is not None and hi is not None
            else (f" >= {lo:g}" if lo is not None else (f" <= {hi:g}" if hi is not None else ""))
        )
        raise _refuse(env, option, value, f"a finite number{bounds}")
    return float(value)


def check_text(env: str, option: str, value: Any) -> str:
    """A non-empty string (an empty observation adds no token: the episode would end)."""
    if not isinstance(value, str) or not value:
        raise _refuse(env, option, value, "a non-empty string")
    return value


def check_bool(env: str, option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _refuse(env, option, value, "true or false")
    return value


def check_choice(env: str, option: str, value: Any, choices: Sequence[str]) -> str:
    """One of `choices`, with the closest one suggested."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(
            f"environment {env}: option {option}={value!r} must be one of {list(choices)}"
            f"{did_you_mean(value, choices)}"
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
        check_int(self.name, "max_turns", self.max_turns, lo=1)

    def texts(self) -> dict[str, str] | None:
        """The fixed text this environment writes into an episode besides the problem's own
        (its prompts, feedback words, observation markup), by what sets it, e.g.
        {"option higher": "higher"}. A character-level task (data.tasks.DigitTask) can play
        the environment only when its vocabulary holds every character of them and of the
        first messages: RunConfig checks both before the run. None (the default): not
        known, so only the first messages are checked (what it answers is not known until
        the run: an observation the task's tokenizer cannot encode fails the run then)."""
        return None

    def check_task(self, task: Any) -> None:
        """Raise ConfigError when this environment cannot play `task` (the run's data.task, a
        data.tasks instance), in one line saying which options to change. RunConfig calls
        it before the run; the default accepts every task."""
        return None

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
