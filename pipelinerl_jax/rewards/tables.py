"""Verdicts and reward tables: what a reward function says, and what the trainer is paid.

A reward function (math verification, a task's partial credit, or a user's callable) returns
a `Verdict`: a status and a success score in [0, 1]. A `RewardTable`, selected by name in the
config, turns the verdict plus the sequence's length into the scalar reward:

  reward = success_weight * score                       (correct / wrong: score; else 0)
         + format_weight * [finished and answer parsed]  (a well-formed answer, right or wrong)
         - soft overlong penalty                         (linear over the last `buffer` tokens)

Tables: `pure_success` (the paper's), `success_and_format`, `soft_overlong` (DAPO-style
penalty, buffer = a quarter of max_tokens unless set). A user reward function is a config
string "module.path:callable" (or a built-in name), resolved here with a one-line error.
"""

import dataclasses
import importlib
import math
from collections.abc import Callable
from typing import Any

from pipelinerl_jax.errors import ConfigError

STATUSES = ("correct", "wrong", "no_answer", "unparsable", "error", "timeout")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a reward function found in one completion."""

    status: str  # one of STATUSES
    score: float = 0.0  # success in [0, 1]: 1/0 for math, partial credit for tasks
    predicted: str | None = None  # the extracted answer, for logs
    detail: str = ""  # why, for error / timeout / unparsable

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"verdict status {self.status!r} is not one of {STATUSES}")
        # A NaN or infinite reward would poison the group's advantages: the answer is scored
        # as an error of the reward function instead, like any other bad return.
        if not math.isfinite(self.score):
            raise ValueError(f"a reward function scored {self.score}; return a finite number")

    @classmethod
    def from_score(cls, score: float) -> "Verdict":
        """A bare score: 'correct' when it is full credit (>= 1), else 'wrong'."""
        score = float(score)
        return cls(status="correct" if score >= 1.0 else "wrong", score=score)


def as_verdict(value: Any) -> Verdict:
    """Normalises what a reward function returned: a Verdict, a number, or a bool."""
    if isinstance(value, Verdict):
        return value
    try:  # also numpy / jax scalars; never text, which float() would also accept
        if isinstance(value, (str, bytes)):
            raise TypeError
        score = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"a reward function returned {type(value).__name__}; return a float or a "
            "pipelinerl_jax.rewards.tables.Verdict"
        ) from None
    return Verdict.from_score(score)


@dataclasses.dataclass(frozen=True)
class RewardParts:
    """A reward and its components, for metrics."""

    reward: float
    success: bool  # status == "correct"
    format_ok: bool  # finished with an answer that parsed (correct or wrong)
    overlong_penalty: float  # >= 0, already subtracted from reward


@dataclasses.dataclass(frozen=True)
class RewardTable:
    """Verdict + length -> reward. Fields are the table's coefficients."""

    name: str  # the table's name in REWARD_TABLES
    success_weight: float = 1.0  # reward of a correct answer (partial credit scales it)
    format_weight: float = 0.0  # bonus for a finished, parseable answer, right or wrong
    overlong_buffer_tokens: int = 0  # penalise lengths in (max_tokens - buffer, max_tokens]
    overlong_buffer_fraction: float = 0.0  # or the buffer as a fraction of max_tokens
    overlong_penalty: float = 1.0  # the penalty at exactly max_tokens

    def __post_init__(self):
        if self.overlong_buffer_tokens < 0 or not 0.0 <= self.overlong_buffer_fraction < 1.0:
            raise ConfigError(
                f"reward table {self.name}: overlong buffer must be >= 0 tokens "
                f"or a fraction in [0, 1) (got {self.overlong_buffer_tokens}, "
                f"{self.overlong_buffer_fraction})"
            )
        if self.overlong_buffer_tokens and self.overlong_buffer_fraction:
            raise ConfigError(
                f"reward table {self.name}: set overlong_buffer_tokens or "
                "overlong_buffer_fraction, not both"
            )

    def buffer(self, max_tokens: int) -> int:
        """Overlong buffer in tokens for a generation limit of max_tokens."""
        if self.overlong_buffer_tokens:
            buf = self.overlong_buffer_tokens
        else:
            buf = int(round(self.overlong_buffer_fraction * max_tokens))
            if self.overlong_buffer_fraction and buf == 0:
                buf = 1
        if buf >= max_tokens > 0:
            raise ConfigError(
                f"reward table {self.name}: overlong buffer {buf} must be smaller "
                f"than max_tokens={max_tokens}"
            )
        return buf

    def compute(
        self, verdict: Verdict, *, num_tokens: int, max_tokens: int, finished: bool
    ) -> RewardParts:
        """Reward of one completion of num_tokens tokens (finished: it ended with EOS)."""
        scored = verdict.status in ("correct", "wrong")
        base = verdict.score if scored else 0.0
        format_ok = finished and scored
        penalty = 0.0
        buf = self.buffer(max_tokens)
        if buf and num_tokens > max_tokens - buf:
            over = min(num_tokens, max_tokens) - (max_tokens - buf)
            penalty = self.overlong_penalty * over / buf
        reward = self.success_weight * base + self.format_weight * format_ok - penalty
        return RewardParts(
            reward=float(reward),
            success=verdict.status == "correct",
            format_ok=format_ok,
            overlong_penalty=float(penalty),
        )


REWARD_TABLES: dict[str, RewardTable] = {
    t.name: t
    for t in (
        RewardTable("pure_success"),
        RewardTable("success_and_format", success_weight=0.9, format_weight=0.1),
        RewardTable("soft_overlong", overlong_buffer_fraction=0.25),
    )
}


def get_reward_table(name: str, **overrides) -> RewardTable:
    """The named table, with any of its coefficients overridden."""
    if name not in REWARD_TABLES:
        raise ConfigError(f"unknown reward table {name!r}; choose one of {sorted(REWARD_TABLES)}")
    fields = {f.name for f in dataclasses.fields(RewardTable)} - {"name"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(
            f"reward table {name}: unknown option(s) {unknown}; valid: {sorted(fields)}"
        )
    return dataclasses.replace(REWARD_TABLES[name], **overrides)


def resolve_callable(spec: str, what: str = "reward function") -> Callable:
    """The callable a "module.path:attr" string names; a one-line ConfigError otherwise."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ConfigError(
            f"{what} {spec!r} must be 'module.path:callable' (e.g. 'my_module:thing')"
        )
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"{what} {spec!r}: cannot import module {module_name!r} ({e}); is it on PYTHONPATH?"
        ) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{what} {spec!r} is a {type(obj).__name__}, not callable")
    return obj


def partial_credit(completion: str, answer: str) -> float:
    """Correct positions / the longer length: 1 for an exact answer, 0 for an empty one."""
    longer = max(len(completion), len(answer))
    if longer == 0:
        return 0.0
    return sum(a == b for a, b in zip(completion, answer)) / longer


def task_reward(completion: str, problem) -> Verdict:
    """Reward of the built-in procedural tasks: partial credit against the gold answer."""
    if getattr(problem, "source", "").startswith("reasoning_gym/"):  # partial credit misleads
        return Verdict(
            status="error",
            detail="reward.fn=task cannot score a reasoning_gym problem; set "
            "--config.reward.fn=reasoning_gym (its dataset's own scorer)",
        )
    if not completion:
        return Verdict(status="no_answer")
    score = partial_credit(completion, problem.answer)
    return Verdict(status="correct" if score == 1.0 else "wrong", score=score, predicted=completion)


# Built-in reward functions by name; anything else is "module.path:callable".
BUILTIN_REWARDS = {
    "math": "pipelinerl_jax.rewards.math:math_reward",
    "task": "pipelinerl_jax.rewards.tables:task_reward",
    "reasoning_gym": "pipelinerl_jax.rewards.reasoning_gym_scorer:reasoning_gym_reward",
}


def reward_fn_spec(name_or_spec: str) -> str:
    """The "module:callable" string for a built-in name or a user spec (validated)."""
    spec = BUILTIN_REWARDS.get(name_or_spec, name_or_spec)
    resolve_callable(spec)
    return spec
