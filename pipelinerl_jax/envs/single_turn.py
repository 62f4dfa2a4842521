"""Any task with a reward function as an environment of one turn: the question, one answer,
its score. Today's single-answer tasks are exactly this, so episodes generalise them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.envs.protocol import Environment, Turn
from pipelinerl_jax.errors import ConfigError, did_you_mean
from pipelinerl_jax.rewards.tables import BUILTIN_REWARDS, as_verdict, resolve_callable


class SingleTurn(Environment):
    name = "single_turn"
    max_turns = 1

    def __init__(self, reward_fn: str | Callable = "math"):
        super().__init__()
        named = isinstance(reward_fn, str) and (reward_fn in BUILTIN_REWARDS or ":" in reward_fn)
        if not (named or callable(reward_fn)):
            raise ConfigError(
                f"environment {self.name}: option reward_fn={reward_fn!r} must be one of "
                f"{sorted(BUILTIN_REWARDS)} or 'module.path:callable'"
                f"{did_you_mean(reward_fn, BUILTIN_REWARDS)}"
            )
        spec = BUILTIN_REWARDS.get(reward_fn, reward_fn) if isinstance(reward_fn, str) else None
        self._spec = spec
        self._fn = resolve_callable(spec) if spec is not None else reward_fn

    @property
    def reward_spec(self) -> str | None:
        """The "module:callable" that scores its answers (None: a callable given as such)."""
        return self._spec

    def __getstate__(self):  # a "module:callable" spec pickles as its string
        return {"_spec": self._spec, "_fn": None if self._spec else self._fn}

    def __setstate__(self, state):
        self._spec = state["_spec"]
        self._fn = resolve_callable(self._spec) if self._spec else state["_fn"]

    def texts(self) -> dict[str, str]:
        return {}  # the question alone

    def first_messages(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": problem.question}]

    def respond(self, problem: Problem, turns: Sequence[str]) -> Turn:
        verdict = as_verdict(self._fn(turns[-1], problem))
        return Turn(None, reward=verdict.score, done=True, info={"status": verdict.status})
