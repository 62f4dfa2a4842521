"""Any task with a reward function, with feedback: a wrong answer hears so, and the model may
try again, up to `max_turns` answers. A right answer on try k earns `discount`**(k-1) of its
score, so answering right at once stays best. The feedback environment for tasks without one
of their own (the guess game's "higher / lower" is guess.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.envs.protocol import Turn, check_int, check_number, check_text
from pipelinerl_jax.envs.single_turn import SingleTurn
from pipelinerl_jax.rewards.tables import as_verdict


class Retry(SingleTurn):
    name = "retry"
    max_turns = 3

    def __init__(
        self,
        reward_fn: str | Callable = "math",
        *,
        max_turns: int | None = None,
        feedback: str = "That is not right. Try again.",
        discount: float = 0.5,
    ):
        super().__init__(reward_fn)
        if max_turns is not None:
            self.max_turns = check_int(self.name, "max_turns", max_turns, lo=1)
        self.feedback = check_text(self.name, "feedback", feedback)
        self.discount = check_number(self.name, "discount", discount, lo=0, hi=1)

    def texts(self) -> dict[str, str]:
        return {"option feedback": self.feedback}

    def __getstate__(self):
        return {**super().__getstate__(), "rest": (self.max_turns, self.feedback, self.discount)}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.max_turns, self.feedback, self.discount = state["rest"]

    def respond(self, problem: Problem, turns: Sequence[str]) -> Turn:
        verdict = as_verdict(self._fn(turns[-1], problem))
        if verdict.status == "correct":
            reward = verdict.score * self.discount ** (len(turns) - 1)
            return Turn(None, reward=reward, done=True, info={"status": "correct"})
        return Turn({"role": "user", "content": self.feedback}, info={"status": verdict.status})
