"""Any task with a reward function, with feedback: a wrong answer hears so, and the model may
try again, up to `max_turns` answers. A right answer on try k earns `discount`**(k-1) of its
score, so answering right at once stays best. The feedback environment for tasks without one
of their own (the guess game's "higher / lower" is guess.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.envs.protocol import Turn
from pipelinerl_jax.envs.single_turn import SingleTurn
from pipelinerl_jax.errors import ConfigError
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
            self.max_turns = max_turns
        if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
            raise ConfigError(f"{self.name}: max_turns={self.max_turns!r} must be an int >= 1")
        if not 0.0 <= discount <= 1.0:
            raise ConfigError(f"{self.name}: discount={discount} must be in [0, 1]")
        self.feedback, self.discount = feedback, discount

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
