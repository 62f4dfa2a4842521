"""Guess a number: the secret is the problem's answer, in [lo, hi] as the question says; each
turn the model names a number and hears "higher", "lower" or "correct". Reward 1 for finding
it within `max_turns` turns. A policy that halves the range finds a number in [0, 15] within
5 turns (16 numbers: 4 turns name at most 15 of them); one that guesses at random rarely does.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.envs.protocol import Environment, Turn

_NUMBER = re.compile(r"-?\d+")


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

    def first_messages(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": problem.question}]

    def respond(self, problem: Problem, turns: Sequence[str]) -> Turn:
        found = _NUMBER.findall(turns[-1])
        if not found:
            return Turn({"role": "user", "content": "a number, please"}, info={"unparsable": 1})
        guess, secret = int(found[-1]), int(problem.answer)
        if guess == secret:
            return Turn(None, reward=1.0, done=True, info={"found_at": len(turns)})
        return Turn({"role": "user", "content": "higher" if guess < secret else "lower"})
