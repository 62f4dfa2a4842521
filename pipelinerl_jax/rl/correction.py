"""Rollout correction (loss.correction): which tokens an off-policy ratio leaves out, and the
sampler/trainer mismatch metrics.

With r = pi/mu the ratio of the trained policy to the sampler's, every objective already
weights or clips r (tis_reinforce truncates it: "none" keeps exactly that). A correction also
*masks* tokens, a stop-gradient 0/1 weight on every term of their loss:

  token_mask       tokens whose r leaves [lo, hi]                       (masked IS, token)
  sequence_mask    sequences whose geometric-mean ratio leaves [lo, hi]  (masked IS, sequence)
  sequence_reject  sequences whose whole-sequence ratio prod_t r_t leaves [lo, hi] (rejection)

What r measures depends on the token. A token sampled at the trainer's own version (lag 0)
has pi = the sampler's policy up to numerics: its r is the sampler/trainer *mismatch* alone.
A token of an older version (lag >= 1) also carries *staleness*: the policy has moved since.
`loss.correction_applies` picks the tokens a correction may mask: "mismatch" (lag 0),
"staleness" (lag >= 1; a sequence whose swap landed mid-answer counts as stale) or "both".
Separating the two inside one stale token would need the trainer's logprobs under the token's
own version, a forward pass of an old copy of the model per version in flight; we measure the
mismatch where it is alone instead.

Metrics (additive sums, finalised in rl/losses.py): over lag-0 tokens, mean and max |log pi -
log mu| and KL(mu || pi) estimated from the sampled tokens (k3 = r - 1 - log r); the fraction
of tokens masked; quantiles of r from a histogram of log r (exact to its bin edges, which is
what lets micro-batches and shards add up).

Letters (pipelinerl_jax/__init__.py): N tokens (any shape), B sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CORRECTIONS = ("none", "token_mask", "sequence_mask", "sequence_reject")
APPLIES = ("both", "staleness", "mismatch")
SEQUENCE_LEVEL = ("sequence_mask", "sequence_reject")

# Bin edges of log r for the ratio histogram; r quantiles are read off at the bin edges.
LOG_RATIO_EDGES = np.array(
    [
        -4,
        -2,
        -1,
        -0.5,
        -0.2,
        -0.1,
        -0.05,
        -0.02,
        -0.01,
        0.0,
        0.01,
        0.02,
        0.05,
        0.1,
        0.2,
        0.5,
        1,
        2,
        4,
    ],
    np.float32,
)
QUANTILES = (0.05, 0.5, 0.95)
sg = jax.lax.stop_gradient


def _per_sequence(values_N, loss_mask, sequence_index, num_sequences, op):
    """op ("sum" | "max") of each sequence's masked values, gathered back per token."""
    idx = sequence_index.reshape(-1)
    vals = jnp.where(loss_mask > 0, values_N, 0.0).reshape(-1)
    seg = jax.ops.segment_sum if op == "sum" else jax.ops.segment_max
    per_B = seg(vals, idx, num_segments=num_sequences + 1)
    return per_B[sequence_index]


def keep_mask(
    mode: str,
    applies: str,
    lo: float,
    hi: float,
    logprobs,
    behaviour_logprobs,
    loss_mask,
    lag,
    sequence_index=None,
    num_sequences: int = 0,
):
    """Per-token 0/1 (float, stop-gradient): 0 where the correction masks the token."""
    on = loss_mask > 0
    log_r = jnp.where(on, sg(logprobs) - behaviour_logprobs, 0.0)
    lo_log, hi_log = np.log(lo), np.log(hi)
    stale = on & (lag >= 1)
    if mode == "none":
        return jnp.ones_like(log_r)
    if mode == "token_mask":
        out = (log_r < lo_log) | (log_r > hi_log)
    else:
        total = _per_sequence(log_r, loss_mask, sequence_index, num_sequences, "sum")
        if mode == "sequence_mask":
            count = _per_sequence(
                on.astype(jnp.float32), loss_mask, sequence_index, num_sequences, "sum"
            )
            total = total / jnp.maximum(count, 1.0)
        out = (total < lo_log) | (total > hi_log)
        # A sequence is stale when any of its tokens is (a swap landed mid-answer).
        stale = (
            _per_sequence(
                stale.astype(jnp.float32), loss_mask, sequence_index, num_sequences, "max"
            )
            > 0
        )
    if applies == "staleness":
        out = out & stale
    elif applies == "mismatch":
        out = out & ~stale
    return jnp.where(on & out, 0.0, 1.0)


STAT_KEYS = frozenset(
    (
        "masked",
        "fresh_tokens",
        "mismatch_abs_sum",
        "max_mismatch_abs",
        "mismatch_k3_sum",
        "ratio_hist",
    )
)


def stats(logprobs, behaviour_logprobs, loss_mask, lag, keep) -> dict:
    """Additive sums for the correction and mismatch metrics (no gradient)."""
    on = loss_mask > 0
    log_r = jnp.where(on, sg(logprobs) - behaviour_logprobs, 0.0)
    fresh = on & (lag <= 0)
    bins = jnp.searchsorted(jnp.asarray(LOG_RATIO_EDGES), log_r.reshape(-1), side="right")
    hist = jnp.zeros(len(LOG_RATIO_EDGES) + 1).at[bins].add(on.reshape(-1).astype(jnp.float32))
    return {
        "masked": jnp.sum(jnp.where(on, 1.0 - keep, 0.0)),
        "fresh_tokens": jnp.sum(fresh.astype(jnp.float32)),
        "mismatch_abs_sum": jnp.sum(jnp.where(fresh, jnp.abs(log_r), 0.0)),
        "max_mismatch_abs": jnp.max(jnp.where(fresh, jnp.abs(log_r), 0.0)),
        "mismatch_k3_sum": jnp.sum(jnp.where(fresh, jnp.exp(log_r) - 1.0 - log_r, 0.0)),
        "ratio_hist": hist,
    }


def finalize(sums: dict, tokens, max_ratio) -> dict:
    """Metrics from accumulated sums (`tokens`: the loss-mask token count; `max_ratio`: the
    largest r, reported for a quantile past the last bin edge)."""
    n = jnp.maximum(tokens, 1.0)
    fresh = jnp.maximum(sums["fresh_tokens"], 1.0)
    out = {
        "correction/masked_frac": sums["masked"] / n,
        "mismatch/tokens_frac": sums["fresh_tokens"] / n,
        "mismatch/abs_mean": sums["mismatch_abs_sum"] / fresh,
        "mismatch/abs_max": sums["max_mismatch_abs"],
        "mismatch/kl": sums["mismatch_k3_sum"] / fresh,
    }
    cum = jnp.cumsum(sums["ratio_hist"]) / n
    upper = jnp.exp(jnp.concatenate([jnp.asarray(LOG_RATIO_EDGES), jnp.zeros(1)]))
    upper = upper.at[-1].set(jnp.maximum(max_ratio, upper[-2]))
    for q in QUANTILES:
        # The upper edge of the bin where the cumulative share first reaches q: r <= it there.
        out[f"ratio/p{int(round(q * 100)):02d}"] = upper[jnp.argmax(cum >= q)]
    return out
