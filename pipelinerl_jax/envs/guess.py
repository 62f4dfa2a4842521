"""Guess a number: the secret is the problem's answer, in [lo, hi] as the question says; each
turn the model names a number and hears "higher", "lower" or nothing more (found). Reward 1
for finding it within `max_turns` turns. Two optional shapings give a policy learning from
scratch a denser signal: `consistency` for each guess inside the range the answers so far
leave open (from `lo`..`hi`), and `closeness` / (1 + d) for a last guess that misses by d. A policy that halves the range finds a number in
[0, 15] within 5 turns (16 numbers: 4 turns name at most 15 of them); one that guesses at
random rarely does.

The words are options, so a character-level model with a small vocabulary can play too: the
`guess_number` preset names numbers in base 16, one character each ("0".."f"), and hears ">"
or "<".
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.envs.protocol import (
    ROLES,
    Environment,
    Turn,
    check_choice,
    check_int,
    check_number,
    check_text,
)
from pipelinerl_jax.errors import ConfigError

_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def problems(n: int, *, lo: int = 0, hi: int = 15, seed: int = 0) -> list[Problem]:
    """n problems with secrets drawn uniformly from [lo, hi]."""
    rng = random.Random(seed)
    return [
        Problem(
            uid=f"guess/{seed}/{i}",
            question=f"Guess my number between {lo} and {hi}.",
            answer=str(rng.randint(lo, hi)),
            source="guess",
        )
        for i in range(n)
    ]


class GuessNumber(Environment):
    name = "guess"
    max_turns = 6

    def __init__(
        self,
        *,
        max_turns: int | None = None,
        higher: str = "higher",
        lower: str = "lower",
        again: str = "a number, please",
        role: str = "user",
        closeness: float = 0.0,
        consistency: float = 0.0,
        lo: int = 0,
        hi: int = 15,
        base: int = 10,
    ):
        super().__init__(max_turns=max_turns)
        base = check_int(self.name, "base", base, lo=2)
        if base > len(_DIGITS):
            raise ConfigError(
                f"environment guess: option base={base} must be in [2, {len(_DIGITS)}]"
            )
        self.base = base
        self._number = re.compile(f"[{_DIGITS[:base]}]+", re.IGNORECASE)
        self.higher, self.lower, self.again = (
            check_text(self.name, option, value)
            for option, value in (("higher", higher), ("lower", lower), ("again", again))
        )
        if self.higher == self.lower:
            raise ConfigError(
                f"environment guess: options higher and lower are both {higher!r}, so the model "
                "cannot tell which way to go; give them different words"
            )
        self.role = check_choice(self.name, "role", role, ROLES)
        self.closeness = check_number(self.name, "closeness", closeness, lo=0)
        self.consistency = check_number(self.name, "consistency", consistency, lo=0)
        # A guess is read as digits, never with a sign: a secret below 0 could not be named.
        self.lo = check_int(self.name, "lo", lo, lo=0)
        self.hi = check_int(self.name, "hi", hi, lo=0)
        if lo > hi:
            raise ConfigError(
                f"environment guess: options lo={lo} > hi={hi}; the secrets' range needs "
                "lo <= hi (the task's own lo and hi)"
            )

    def texts(self) -> dict[str, str]:
        return {
            "option higher": self.higher,
            "option lower": self.lower,
            "option again": self.again,
        }

    def check_task(self, task: Any) -> None:
        # guess_number draws its secrets from its own lo..hi: a different range here would
        # pay `consistency` for guesses the secrets rule out (or none for a secret outside it).
        task_range = getattr(task, "lo", None), getattr(task, "hi", None)
        if None not in task_range and task_range != (self.lo, self.hi):
            raise ConfigError(
                f"environment guess: options lo={self.lo}, hi={self.hi} differ from task "
                f"{task.name}'s lo={task_range[0]}, hi={task_range[1]}, where its secrets come "
                "from; give env.options the task's lo and hi"
            )

    def first_messages(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": problem.question}]

    def _guess(self, turn: str) -> int | None:
        found = self._number.findall(turn)
        return int(found[-1], self.base) if found else None

    def _open_range(self, earlier: Sequence[str], secret: int) -> tuple[int, int]:
        """What the answers to `earlier` guesses leave possible."""
        lo, hi = self.lo, self.hi
        for guess in map(self._guess, earlier):
            if guess is not None and guess < secret:
                lo = max(lo, guess + 1)
            elif guess is not None and guess > secret:
                hi = min(hi, guess - 1)
        return lo, hi

    def respond(self, problem: Problem, turns: Sequence[str]) -> Turn:
        guess, secret = self._guess(turns[-1]), int(problem.answer)
        if guess is None:
            return Turn({"role": self.role, "content": self.again}, info={"unparsable": 1})
        reward = 0.0
        if self.consistency:
            lo, hi = self._open_range(turns[:-1], secret)
            reward += self.consistency * (lo <= guess <= hi)
        if guess == secret:
            return Turn(None, reward=reward + 1.0, done=True, info={"status": "correct"})
        feedback = self.higher if guess < secret else self.lower
        if len(turns) >= self.max_turns:
            reward += self.closeness / (1 + abs(guess - secret))
        return Turn(
            {"role": self.role, "content": feedback}, reward=reward, info={"status": "wrong"}
        )
