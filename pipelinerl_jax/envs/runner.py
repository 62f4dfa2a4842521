"""Environment turns in worker processes with a per-turn timeout: an environment that hangs,
crashes or answers garbage ends its episode with an error turn (reward 0, a status the
metrics count), never the run. The pool is rewards/workers.RewardPool with turns in place of
verdicts.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.envs.protocol import Environment, Turn, as_turn, failed_turn
from pipelinerl_jax.rewards.workers import RewardPool


def respond(env: Environment, problem: Problem, turns: Sequence[str]) -> Turn:
    """One turn of `env`, ended at its max_turns (what a worker runs)."""
    return env.final(problem, list(turns))


class EnvironmentPool:
    """`submit(env, problem, turns)` -> a Future of the Turn; always resolves."""

    def __init__(self, *, num_workers: int = 2, timeout_s: float = 5.0, start_method="forkserver"):
        self._pool = RewardPool(
            respond,
            num_workers=num_workers,
            timeout_s=timeout_s,
            start_method=start_method,
            result=as_turn,
            failure=failed_turn,
        )

    @property
    def stats(self):
        return self._pool.stats

    def submit(self, env: Environment, problem: Problem, turns: Sequence[str]):
        return self._pool.submit(env, problem, tuple(turns))

    def respond(self, env: Environment, problem: Problem, turns: Sequence[str]) -> Turn:
        return self.submit(env, problem, turns).result()

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> EnvironmentPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
