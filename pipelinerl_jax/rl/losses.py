"""Policy-gradient objectives as pure functions: per-token logprobs in, (loss, metrics) out.

Every objective is sum_t w_t * loss_t over completion tokens, with token weights w fixed on
the host (rl/weights.py), so micro-batches and data-parallel shards simply add up. The
per-token losses loss_t live in the registry of rl/objectives.py (register your own there).
With rho = pi/mu the ratio of the trained policy to the sampler's (behaviour) policy and A the
advantage, the built-ins are:

  tis_reinforce  loss_t = -stopgrad(min(rho, c)) * A * log pi      (the paper; c = 5)
  ppo            loss_t = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
  gspo           as ppo, with rho replaced by the sequence ratio s = exp(mean_t log rho)
                 (token form sg(s) * pi/sg(pi): same value, gradient s * A * grad log pi)
  cispo          loss_t = -stopgrad(clip(rho, 1 - eps_low, 1 + eps_high)) * A * log pi
                 (MiniMax-M1: the weight is clipped, every token keeps its gradient)

plus optional kl_coef * k3(pi || ref) and -entropy_coef * entropy, per token, for every
objective. Metrics are first accumulated as additive sums ("max_" keys combine by max) so that
micro-batches can be merged exactly, then finalised: ESS = (sum rho)^2 / (sum rho^2) / N, etc.
Letters (pipelinerl_jax/__init__.py): N tokens (any shape), B sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipelinerl_jax.rl import correction as correction_lib
from pipelinerl_jax.rl.config import LossConfig
from pipelinerl_jax.rl.logprobs import chunked_logprobs, fused_token_loss
from pipelinerl_jax.rl.objectives import Objective, TokenContext, get_objective

sg = jax.lax.stop_gradient


def _k3(log_q_over_p):
    """k3 = e^x - x - 1 >= 0 with x = log q/p: an estimate of KL(p || q) from samples of p."""
    return jnp.exp(log_q_over_p) - log_q_over_p - 1.0


def _entry(objective: str | Objective) -> Objective:
    return objective if isinstance(objective, Objective) else get_objective(objective)


def _total_term(entry, lp, ent, ctx, w, ref, *, kl_coef, entropy_coef, options):
    """sum_t w_t * (policy loss + kl_coef * k3 - entropy_coef * entropy): what is differentiated."""
    total = entry(lp, ctx, **options)[0]
    if ref is not None:
        total = total + kl_coef * _k3(ref - lp)
    if ent is not None:
        total = total - entropy_coef * ent
    return jnp.sum(w * total)


def sequence_ratio(logprobs, behaviour_logprobs, loss_mask, sequence_index, num_sequences):
    """Per-token s = exp(mean of log(pi/mu) over the token's sequence); 1 where unassigned."""
    log_ratio = jnp.where(loss_mask > 0, logprobs - behaviour_logprobs, 0.0).reshape(-1)
    idx = sequence_index.reshape(-1)
    total_B = jax.ops.segment_sum(log_ratio, idx, num_segments=num_sequences + 1)
    count_B = jax.ops.segment_sum(loss_mask.reshape(-1), idx, num_segments=num_sequences + 1)
    ratio_B = jnp.exp(total_B / jnp.maximum(count_B, 1.0)).at[num_sequences].set(1.0)
    return ratio_B[sequence_index]


# The additive sums objective_stats returns; finalize turns them into metrics.
STAT_KEYS = frozenset(
    (
        "tokens",
        "pg_loss",
        "ratio_sum",
        "ratio_sq_sum",
        "max_ratio",
        "clipped",
        "kl_new_old_sum",
        "entropy_sum",
        "loss",
    )
)


def objective_stats(
    objective: str | Objective,
    logprobs,
    entropy,
    behaviour_logprobs,
    advantages,
    token_weights,
    loss_mask,
    ref_logprobs=None,
    *,
    kl_coef,
    entropy_coef,
    seq_ratio=None,
    **options,
) -> dict:
    """Additive sums for the metrics (no gradient flows through them).

    objective: a registered name or entry; options: its token_loss keywords (those it does not
    take are ignored, so one set of keywords can serve every objective).
    """
    entry = _entry(objective)
    options = {k: v for k, v in options.items() if k in entry.options}
    lp, mu, m = sg(logprobs), behaviour_logprobs, loss_mask
    on = m > 0
    pg, flag = entry(lp, TokenContext(mu, advantages, seq_ratio), **options)
    log_rho = jnp.where(on, lp - mu, 0.0)
    rho = jnp.exp(log_rho)
    stats = {
        "tokens": jnp.sum(m),
        "pg_loss": jnp.sum(token_weights * pg),
        "ratio_sum": jnp.sum(m * rho),
        "ratio_sq_sum": jnp.sum(m * rho * rho),
        "max_ratio": jnp.max(jnp.where(on, rho, 0.0)),
        "clipped": jnp.sum(jnp.where(on & flag, 1.0, 0.0)),
        # KL(new || old) from old samples: E_mu[rho log rho - rho + 1], each term >= 0.
        "kl_new_old_sum": jnp.sum(m * (rho * log_rho - rho + 1.0)),
        "entropy_sum": jnp.sum(m * sg(entropy)) if entropy is not None else jnp.zeros(()),
    }
    loss = stats["pg_loss"]
    if ref_logprobs is not None:
        kl = _k3(ref_logprobs - lp)
        stats["kl_ref_sum"] = jnp.sum(m * kl)
        loss = loss + kl_coef * jnp.sum(token_weights * kl)
    if entropy is not None:
        loss = loss - entropy_coef * jnp.sum(token_weights * sg(entropy))
    stats["loss"] = loss
    return stats


def accumulate(a: dict, b: dict) -> dict:
    """Merges two stats dicts: sums, and maxima for "max_" keys."""
    return {k: jnp.maximum(a[k], b[k]) if k.startswith("max_") else a[k] + b[k] for k in a}


def finalize(stats: dict) -> dict:
    """Metrics from accumulated sums.

    The sums of objective_stats become the standard metrics (ESS, clip fraction, ...); any
    other key (a custom loss function's own sums) is reported as accumulated.
    """
    if not STAT_KEYS <= stats.keys():  # a custom loss's own sums: every key as accumulated
        return dict(stats)
    skip = STAT_KEYS | correction_lib.STAT_KEYS | {"kl_ref_sum"}
    out = {k: v for k, v in stats.items() if k not in skip}
    out["loss"] = stats["loss"]
    n = jnp.maximum(stats["tokens"], 1.0)
    out.update(
        pg_loss=stats["pg_loss"],
        tokens=stats["tokens"],
        ess=stats["ratio_sum"] ** 2 / jnp.maximum(stats["ratio_sq_sum"], 1e-30) / n,
        ratio_mean=stats["ratio_sum"] / n,
        ratio_max=stats["max_ratio"],
        clip_fraction=stats["clipped"] / n,
        kl_new_old=stats["kl_new_old_sum"] / n,
        entropy=stats["entropy_sum"] / n,
    )
    if "kl_ref_sum" in stats:
        out["kl_ref"] = stats["kl_ref_sum"] / n
    if correction_lib.STAT_KEYS <= stats.keys():
        out.update(correction_lib.finalize(stats, stats["tokens"], stats["max_ratio"]))
    return out


def objective_loss(
    objective: str | Objective,
    logprobs,
    behaviour_logprobs,
    advantages,
    token_weights,
    loss_mask,
    sequence_index=None,
    num_sequences: int | None = None,
    *,
    entropy=None,
    ref_logprobs=None,
    kl_coef=0.0,
    entropy_coef=0.0,
    **options,
):
    """(loss, metrics) of any registered objective from per-token logprobs.

    options: the objective's token_loss keywords; those not given take the LossConfig
    defaults of the fields the objective was registered with. sequence_index and
    num_sequences (see `gspo`) are needed by objectives registered with sequence_ratio=True.
    """
    entry = _entry(objective)
    unknown = sorted(set(options) - set(entry.options))
    if unknown:
        raise TypeError(
            f"objective {entry.name!r} takes options {sorted(entry.options)}, not {unknown}"
        )
    options = {**entry.options_from(LossConfig()), **options}
    seq_ratio = None
    if entry.sequence_ratio:
        if sequence_index is None or num_sequences is None:
            raise TypeError(f"objective {entry.name!r} needs sequence_index and num_sequences")
        seq_ratio = sg(
            sequence_ratio(logprobs, behaviour_logprobs, loss_mask, sequence_index, num_sequences)
        )
    ctx = TokenContext(behaviour_logprobs, advantages, seq_ratio)
    loss = _total_term(
        entry,
        logprobs,
        entropy,
        ctx,
        token_weights,
        ref_logprobs,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        options=options,
    )
    stats = objective_stats(
        entry,
        logprobs,
        entropy,
        behaviour_logprobs,
        advantages,
        token_weights,
        loss_mask,
        ref_logprobs,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        seq_ratio=seq_ratio,
        **options,
    )
    return loss, finalize(stats)


def tis_reinforce(
    logprobs,
    behaviour_logprobs,
    advantages,
    token_weights,
    loss_mask,
    *,
    clip: float = 5.0,
    entropy=None,
    ref_logprobs=None,
    kl_coef=0.0,
    entropy_coef=0.0,
):
    """Truncated-IS REINFORCE: -sum w * sg(min(pi/mu, clip)) * A * log pi. -> (loss, metrics)"""
    return objective_loss(
        "tis_reinforce",
        logprobs,
        behaviour_logprobs,
        advantages,
        token_weights,
        loss_mask,
        entropy=entropy,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        clip=clip,
    )


def ppo(
    logprobs,
    behaviour_logprobs,
    advantages,
    token_weights,
    loss_mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    entropy=None,
    ref_logprobs=None,
    kl_coef=0.0,
    entropy_coef=0.0,
):
    """PPO clipped surrogate with asymmetric clipping, per token. -> (loss, metrics)"""
    return objective_loss(
        "ppo",
        logprobs,
        behaviour_logprobs,
        advantages,
        token_weights,
        loss_mask,
        entropy=entropy,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        eps_low=eps_low,
        eps_high=eps_high,
    )


def cispo(
    logprobs,
    behaviour_logprobs,
    advantages,
    token_weights,
    loss_mask,
    *,
    eps_low: float = 1.0,
    eps_high: float = 5.0,
    entropy=None,
    ref_logprobs=None,
    kl_coef=0.0,
    entropy_coef=0.0,
):
    """CISPO: -sum w * sg(clip(pi/mu, 1 - eps_low, 1 + eps_high)) * A * log pi. -> (loss,
    metrics)"""
    return objective_loss(
        "cispo",
        logprobs,
        behaviour_logprobs,
        advantages,
        token_weights,
        loss_mask,
        entropy=entropy,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        eps_low=eps_low,
        eps_high=eps_high,
    )


def gspo(
    logprobs,
    behaviour_logprobs,
    advantages,
    token_weights,
    loss_mask,
    sequence_index,
    num_sequences: int,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    entropy=None,
    ref_logprobs=None,
    kl_coef=0.0,
    entropy_coef=0.0,
):
    """GSPO: clipped surrogate on the sequence-level geometric-mean ratio. -> (loss, metrics)

    sequence_index maps each token to its sequence in [0, num_sequences) (num_sequences for
    tokens outside every sequence). Pair with weighting="sequence_mean" for the GSPO paper's
    length-normalised form.
    """
    return objective_loss(
        "gspo",
        logprobs,
        behaviour_logprobs,
        advantages,
        token_weights,
        loss_mask,
        sequence_index,
        num_sequences,
        entropy=entropy,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        eps_low=eps_low,
        eps_high=eps_high,
    )


def loss_from_hidden(
    cfg: LossConfig,
    hidden_xE,
    w_ExV,
    batch,
    *,
    kl_coef=0.0,
    entropy_coef=0.0,
    ref_logprobs=None,
    num_sequences: int,
    version=None,
):
    """(loss, stats) of one (micro-)batch straight from the model's final hidden states.

    version: the trainer's version (traced), which makes each token's lag for the rollout
    correction and the mismatch metrics (rl/correction.py); None (or a batch without
    `versions`) counts every token as lag 0.

    batch: a TrainBatch (or its token fields, sliced to a micro-batch). cfg.objective is looked
    up in the registry; per-token objectives (built-in or registered) take the fused head path,
    those that need the sequence ratio (gspo) compute chunked logprobs first. Stats are additive
    sums (merge with `accumulate`, then `finalize`).
    """
    entry = get_objective(cfg.objective)
    options = entry.options_from(cfg)
    on = batch.loss_mask > 0
    lag = jnp.zeros(batch.loss_mask.shape, jnp.int32)
    versions = getattr(batch, "versions", None)  # a caller's token fields may lack them
    if version is not None and versions is not None:
        lag = jnp.where(on, jnp.asarray(version, jnp.int32) - versions, 0)
    corr = (cfg.correction, cfg.correction_applies, cfg.correction_low, cfg.correction_high)
    inputs = dict(mu=batch.behaviour_logprobs, adv=batch.advantages, w=batch.token_weights)
    if cfg.correction != "none":
        inputs.update(lag=lag, mask=batch.loss_mask)
    if ref_logprobs is not None:
        inputs["ref"] = ref_logprobs
    use_entropy = cfg.entropy_coef > 0 or (cfg.entropy_coef_end or 0) > 0
    total = dict(kl_coef=kl_coef, entropy_coef=entropy_coef, options=options)
    seq_ratio = None
    if cfg.fused:

        def token_loss(lp, ent, inp):
            ctx = TokenContext(inp["mu"], inp["adv"])
            ent = ent if use_entropy else None
            w = inp["w"]
            if cfg.correction != "none":  # token_mask: per token, so per chunk
                w = w * correction_lib.keep_mask(*corr, lp, inp["mu"], inp["mask"], inp["lag"])
            return _total_term(entry, lp, ent, ctx, w, inp.get("ref"), **total)

        loss, lp, ent = fused_token_loss(
            hidden_xE,
            w_ExV,
            batch.targets,
            inputs,
            token_loss,
            temperature=cfg.temperature,
            token_chunk=cfg.token_chunk,
            head_dtype=cfg.head_dtype,
        )
    else:
        lp, ent = chunked_logprobs(
            hidden_xE,
            w_ExV,
            batch.targets,
            temperature=cfg.temperature,
            vocab_chunk=cfg.vocab_chunk,
            head_dtype=cfg.head_dtype,
        )
        # Stop-gradient, as TokenContext promises: the ratio weights tokens, it is not trained.
        seq_ratio = sg(
            sequence_ratio(
                lp, batch.behaviour_logprobs, batch.loss_mask, batch.sequence_index, num_sequences
            )
        )
        ctx = TokenContext(batch.behaviour_logprobs, batch.advantages, seq_ratio)
        ent_or_none = ent if use_entropy else None
        keep = correction_lib.keep_mask(
            *corr,
            lp,
            batch.behaviour_logprobs,
            batch.loss_mask,
            lag,
            batch.sequence_index,
            num_sequences,
        )
        loss = _total_term(entry, lp, ent_or_none, ctx, inputs["w"] * keep, ref_logprobs, **total)
    stats = objective_stats(
        entry,
        lp,
        ent,
        batch.behaviour_logprobs,
        batch.advantages,
        batch.token_weights,
        batch.loss_mask,
        ref_logprobs,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef if use_entropy else 0.0,
        seq_ratio=seq_ratio,
        **options,
    )
    if cfg.fused:  # the fused path masked chunk by chunk inside its custom VJP: once more here
        keep = correction_lib.keep_mask(*corr, lp, batch.behaviour_logprobs, batch.loss_mask, lag)
    stats.update(correction_lib.stats(lp, batch.behaviour_logprobs, batch.loss_mask, lag, keep))
    return loss, stats


def advantage_metrics(sequence_advantages, rewards, sequence_mask) -> dict:
    """Mean/std/min/max of the step's sequence advantages, and its mean reward."""
    on = sequence_mask > 0
    n = jnp.maximum(jnp.sum(sequence_mask), 1.0)
    mean = jnp.sum(sequence_mask * sequence_advantages) / n
    var = jnp.sum(sequence_mask * (sequence_advantages - mean) ** 2) / n
    big = jnp.finfo(jnp.float32).max
    return {
        "adv_mean": mean,
        "adv_std": jnp.sqrt(var),
        "adv_min": jnp.min(jnp.where(on, sequence_advantages, big)),
        "adv_max": jnp.max(jnp.where(on, sequence_advantages, -big)),
        "reward_mean": jnp.sum(sequence_mask * rewards) / n,
        "sequences": jnp.sum(sequence_mask),
    }
