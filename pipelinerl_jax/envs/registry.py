"""Environments by name: the shipped ones, or a user's own as "module.path:callable".

The callable is an Environment subclass or any function returning an Environment; the
config's options are its keyword arguments, and `max_turns` (when set) is one of them.
"""

from __future__ import annotations

from pipelinerl_jax.envs.calculator import Calculator
from pipelinerl_jax.envs.equations import Equations
from pipelinerl_jax.envs.guess import GuessNumber
from pipelinerl_jax.envs.protocol import Environment
from pipelinerl_jax.envs.retry import Retry
from pipelinerl_jax.envs.single_turn import SingleTurn
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.tables import resolve_callable

ENVIRONMENTS = {cls.name: cls for cls in (Calculator, Equations, GuessNumber, Retry, SingleTurn)}


def make_env(name: str, options: dict | None = None, *, max_turns: int = 0) -> Environment:
    """The environment `name` built with `options`; one-line ConfigErrors for a bad name, bad
    options, or a callable that does not return an Environment."""
    options = dict(options or {})
    if max_turns:
        options["max_turns"] = max_turns
    if name in ENVIRONMENTS:
        factory = ENVIRONMENTS[name]
    elif ":" in name:
        factory = resolve_callable(name, "environment")
    else:
        raise ConfigError(
            f"unknown environment {name!r}: use one of {sorted(ENVIRONMENTS)} or "
            "'module.path:callable'"
        )
    try:
        env = factory(**options)
    except TypeError as e:
        raise ConfigError(f"environment {name!r}: bad options {sorted(options)} ({e})") from None
    if not isinstance(env, Environment):
        raise ConfigError(
            f"environment {name!r} returned a {type(env).__name__}, not a "
            "pipelinerl_jax.envs.Environment"
        )
    return env
