"""Environments by name: the shipped ones, or a user's own as "module.path:callable".

The callable is an Environment subclass or any function returning an Environment; the
config's options are its keyword arguments, and `max_turns` (config.env.max_turns, when set)
is one of them.
"""

from __future__ import annotations

import inspect

from pipelinerl_jax.envs.calculator import Calculator
from pipelinerl_jax.envs.equations import Equations
from pipelinerl_jax.envs.guess import GuessNumber
from pipelinerl_jax.envs.protocol import Environment
from pipelinerl_jax.envs.python_tool import PythonTool
from pipelinerl_jax.envs.retry import Retry
from pipelinerl_jax.envs.single_turn import SingleTurn
from pipelinerl_jax.errors import ConfigError, did_you_mean
from pipelinerl_jax.rewards.tables import resolve_callable

ENVIRONMENTS = {
    cls.name: cls for cls in (Calculator, Equations, GuessNumber, PythonTool, Retry, SingleTurn)
}


def make_env(name: str, options: dict | None = None, *, max_turns: int = 0) -> Environment:
    """The environment `name` built with `options` and, when not 0, `max_turns` (the config's
    env.max_turns); one-line ConfigErrors for a bad name, bad options, or a callable that
    does not return an Environment."""
    options = dict(options or {})
    if name in ENVIRONMENTS:
        factory = ENVIRONMENTS[name]
    elif ":" in name:
        factory = resolve_callable(name, "environment")
    else:
        raise ConfigError(
            f"unknown environment {name!r}: use one of {sorted(ENVIRONMENTS)} or "
            f"'module.path:callable'{did_you_mean(name, ENVIRONMENTS)}"
        )
    _check_options(name, factory, options, max_turns)
    if max_turns:
        options["max_turns"] = max_turns
    try:
        env = factory(**options)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a user's factory refusing its options its own way
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(
            f"environment {name!r}: options {options} refused ({type(e).__name__}: {first}); "
            "fix config.env.options"
        ) from None
    if not isinstance(env, Environment):
        raise ConfigError(
            f"environment {name!r} returned a {type(env).__name__}, not a "
            "pipelinerl_jax.envs.Environment"
        )
    return env


def _check_options(name: str, factory, options: dict, max_turns: int) -> None:
    """Options the factory does not take, and env.max_turns where it cannot apply."""
    if max_turns and "max_turns" in options and options["max_turns"] != max_turns:
        raise ConfigError(
            f"config.env.max_turns={max_turns} and env.options max_turns="
            f"{options['max_turns']!r} disagree; set one of them"
        )
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read: the call itself will say
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes = [n for n, p in params.items() if p.kind in keyword]
    if max_turns and "max_turns" not in takes:
        turns = getattr(factory, "max_turns", None)
        plays = f" (it plays {turns} turn{'s' * (turns != 1)})" if isinstance(turns, int) else ""
        raise ConfigError(
            f"config.env.max_turns={max_turns}: environment {name!r} takes no max_turns"
            f"{plays}; leave env.max_turns at 0"
        )
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise ConfigError(
            f"config.env.options {unknown[0]!r}: environment {name!r} has no such option"
            f"{did_you_mean(unknown[0], takes)}; valid: {sorted(takes)}"
        )
