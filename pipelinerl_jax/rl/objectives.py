"""The registry of policy-gradient objectives, each written as a per-token loss.

An objective is a function of one token's logprob under the trained policy and its context:

    token_loss(logprobs_N, ctx, **options) -> loss_N  or  (loss_N, clipped_N)

- `logprobs_N`: log pi of the target tokens (any shape N; differentiable);
- `ctx`: a `TokenContext` of arrays shaped like logprobs_N: the sampler's (behaviour)
  logprobs mu, the advantages A and, for objectives registered with `sequence_ratio=True`, the
  stop-gradient sequence ratio s = exp(mean over the token's sequence of log pi/mu);
- `options`: python floats, read from the `LossConfig` fields the registration names;
- `loss_N`: the per-token loss (the step's loss is sum_t w_t * loss_t with the host's token
  weights w); `clipped_N` (bool, optional) marks the tokens counted in the `clip_fraction`
  metric.

The loss must be finite wherever the inputs are zero (padding tokens) and must not mix tokens:
that is what lets rl/losses.py sum it over micro-batches, data-parallel shards and token chunks
of the fused LM-head path (rl/logprobs.fused_token_loss), and add the KL and entropy terms
around it. An objective that needs whole sequences first declares `sequence_ratio=True`: it
then gets ctx.sequence_ratio and the unfused path (logprobs of every token, then the loss).

Register with `register_objective(name, fn, options={...})` or as a decorator, then select it
with `LossConfig(objective=name)`; the three built-ins below are registered the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pipelinerl_jax.errors import ConfigError

sg = jax.lax.stop_gradient


class TokenContext(NamedTuple):
    """Per-token inputs of an objective besides the trained logprobs (same shape, no gradient)."""

    behaviour_logprobs: jax.Array  # mu: log-probabilities under the sampler's policy
    advantages: jax.Array  # A: the token's (sequence's) advantage
    sequence_ratio: jax.Array | None = None  # s = exp(mean_seq log pi/mu), stop-gradient;
    #   only for objectives registered with sequence_ratio=True, else None


TokenLoss = Callable[..., Any]  # (logprobs_N, ctx, **options) -> loss_N | (loss_N, clipped_N)


@dataclasses.dataclass(frozen=True)
class Objective:
    """A registry entry: the per-token loss and what it needs from the config."""

    name: str
    token_loss: TokenLoss
    options: Mapping[str, str]  # token_loss keyword -> the LossConfig field that supplies it
    sequence_ratio: bool = False  # needs ctx.sequence_ratio (whole sequences: no fused head)

    def options_from(self, cfg) -> dict[str, float]:
        """The keyword arguments of token_loss, read from a LossConfig (ConfigError if the
        registration named fields it lacks)."""
        fields = {f.name for f in dataclasses.fields(cfg)}
        unknown = sorted(field for field in self.options.values() if field not in fields)
        if unknown:
            raise ConfigError(
                f"objective {self.name!r}: options name {unknown}, not LossConfig fields; use "
                f"fields of {sorted(fields)}"
            )
        return {kw: getattr(cfg, field) for kw, field in self.options.items()}

    def __call__(self, logprobs_N, ctx: TokenContext, **options):
        """(loss_N, clipped_N): token_loss with the flag filled in (all False) when omitted."""
        out = self.token_loss(logprobs_N, ctx, **options)
        if isinstance(out, tuple):
            return out
        return out, jnp.zeros(jnp.shape(out), bool)


_REGISTRY: dict[str, Objective] = {}
# The built-ins, registered below; they can be neither replaced nor removed.
OBJECTIVES = ("tis_reinforce", "ppo", "gspo", "cispo")
BUILTIN = OBJECTIVES


def register_objective(
    name: str,
    fn: TokenLoss | None = None,
    *,
    options: Mapping[str, str] | None = None,
    sequence_ratio: bool = False,
    replace: bool = False,
):
    """Registers `fn` as objective `name`; without `fn`, returns a decorator that does.

    options: {token_loss keyword: LossConfig field}, e.g. {"clip": "tis_clip"}, so that the
    value comes from the config (and its command-line flag); constants of your own can simply
    be closed over instead. The fields are checked when a LossConfig selects the objective
    (this module stays below rl/config.py, which imports it). sequence_ratio: fn reads ctx.sequence_ratio (see the module
    docstring). A name already registered raises ConfigError unless replace=True (built-ins
    can never be replaced). Returns fn, so the decorator leaves the function usable as is.
    """
    if fn is None:
        return lambda f: register_objective(
            name, f, options=options, sequence_ratio=sequence_ratio, replace=replace
        )
    options = dict(options or {})
    if not callable(fn):
        raise ConfigError(f"objective {name!r}: {fn!r} is not callable")
    if name in _REGISTRY and (name in BUILTIN or not replace):
        how = "built-ins cannot be replaced" if name in BUILTIN else "pass replace=True"
        raise ConfigError(f"objective {name!r} is already registered ({how})")
    _REGISTRY[name] = Objective(name, fn, options, sequence_ratio)
    return fn


def unregister_objective(name: str) -> None:
    """Removes a registered objective (not a built-in); unknown names are ignored."""
    if name in BUILTIN:
        raise ConfigError(f"objective {name!r} is a built-in and cannot be unregistered")
    _REGISTRY.pop(name, None)


def registered_objectives() -> tuple[str, ...]:
    """Names of every registered objective, built-ins first."""
    return tuple(_REGISTRY)


def get_objective(name: str) -> Objective:
    """The registry entry for `name`; ConfigError naming the registered ones if unknown."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"loss.objective={name!r} is not a registered objective; use one of "
            f"{registered_objectives()} or register it with "
            "pipelinerl_jax.rl.objectives.register_objective"
        ) from None


# --- the built-ins -------------------------------------------------------------------------


def _clipped_surrogate(ratio_N, advantages_N, eps_low, eps_high):
    """PPO's pessimistic clipped surrogate and which tokens the clip decided."""
    unclipped_N = ratio_N * advantages_N
    clipped_N = jnp.clip(ratio_N, 1.0 - eps_low, 1.0 + eps_high) * advantages_N
    return -jnp.minimum(unclipped_N, clipped_N), clipped_N < unclipped_N


@register_objective("tis_reinforce", options={"clip": "tis_clip"})
def tis_reinforce(logprobs_N, ctx: TokenContext, *, clip: float):
    """-stopgrad(min(pi/mu, clip)) * A * log pi: truncated-IS REINFORCE (the paper)."""
    ratio_N = jnp.exp(logprobs_N - ctx.behaviour_logprobs)
    return -sg(jnp.minimum(ratio_N, clip)) * ctx.advantages * logprobs_N, ratio_N > clip


@register_objective("ppo", options={"eps_low": "ppo_eps_low", "eps_high": "ppo_eps_high"})
def ppo(logprobs_N, ctx: TokenContext, *, eps_low: float, eps_high: float):
    """-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) with rho = pi/mu."""
    ratio_N = jnp.exp(logprobs_N - ctx.behaviour_logprobs)
    return _clipped_surrogate(ratio_N, ctx.advantages, eps_low, eps_high)


@register_objective(
    "gspo",
    options={"eps_low": "gspo_eps_low", "eps_high": "gspo_eps_high"},
    sequence_ratio=True,
)
def gspo(logprobs_N, ctx: TokenContext, *, eps_low: float, eps_high: float):
    """PPO's surrogate on the sequence ratio s, in token form sg(s) * pi/sg(pi): the value is
    s, and the gradient s * grad log pi, summed over the sequence's tokens, is GSPO's."""
    ratio_N = sg(ctx.sequence_ratio) * jnp.exp(logprobs_N - sg(logprobs_N))
    return _clipped_surrogate(ratio_N, ctx.advantages, eps_low, eps_high)


@register_objective("cispo", options={"eps_low": "cispo_eps_low", "eps_high": "cispo_eps_high"})
def cispo(logprobs_N, ctx: TokenContext, *, eps_low: float, eps_high: float):
    """-sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * log pi (MiniMax-M1's CISPO).

    The importance weight is clipped, never the gradient: unlike PPO, a token whose ratio
    leaves the trust region still contributes (rare, high-ratio tokens are often the
    reflective ones RL should reinforce); only its weight is bounded."""
    ratio_N = jnp.exp(logprobs_N - ctx.behaviour_logprobs)
    weight_N = jnp.clip(ratio_N, 1.0 - eps_low, 1.0 + eps_high)
    return -sg(weight_N) * ctx.advantages * logprobs_N, weight_N != ratio_N
