"""Objectives and their metrics against hand computations (rl/losses.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.rl import lag, losses
from pipelinerl_jax.rl.batch import ScoredSample, build_batch
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.rl.logprobs import full_logprobs

LP = np.array([-1.0, -2.0, -0.5, -1.5, -3.0], np.float32)
MU = np.array([-1.2, -2.0, -3.0, -1.0, -2.0], np.float32)
ADV = np.array([1.0, -1.0, 2.0, 0.5, -1.0], np.float32)
W = np.array([0.5, 0.5, 1.0, 0.25, 0.5], np.float32)
MASK = np.ones(5, np.float32)
RHO = np.exp(LP.astype(np.float64) - MU)  # [e^.2, 1, e^2.5, e^-.5, e^-1]


def _value_and_grad(fn, lp=LP):
    """(loss, metrics, d loss / d logprobs) of fn(logprobs) under one jit."""
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(jnp.asarray(lp))


def test_tis_reinforce_by_hand():
    (loss, m), g = _value_and_grad(lambda lp: losses.tis_reinforce(lp, MU, ADV, W, MASK, clip=5.0))
    coef = np.minimum(RHO, 5.0)  # token 2 (rho = 12.18) is clamped to 5
    np.testing.assert_allclose(loss, -(W * coef * ADV * LP).sum(), rtol=1e-5)
    np.testing.assert_allclose(loss, 0.61070 - 1.0 + 5.0 + 0.11372 - 0.5 * 0.36788 * 3, rtol=1e-4)
    np.testing.assert_allclose(g, -W * coef * ADV, rtol=1e-5)
    np.testing.assert_allclose(m["clip_fraction"], 1 / 5)
    np.testing.assert_allclose(m["ratio_max"], np.exp(2.5), rtol=1e-5)
    np.testing.assert_allclose(m["ess"], RHO.sum() ** 2 / (RHO**2).sum() / 5, rtol=1e-5)
    np.testing.assert_allclose(m["kl_new_old"], (RHO * np.log(RHO) - RHO + 1).mean(), rtol=1e-5)


def test_ppo_by_hand():
    (loss, m), g = _value_and_grad(
        lambda lp: losses.ppo(lp, MU, ADV, W, MASK, eps_low=0.2, eps_high=0.28)
    )
    # token: 0 in range; 1 ratio 1; 2 A>0 above 1.28 (clipped); 3 A>0 below 0.8 (min keeps
    # rho*A: not clipped); 4 A<0 below 0.8 (clipped at 0.8).
    per_token = -np.array([RHO[0] * 1, RHO[1] * -1, 1.28 * 2, RHO[3] * 0.5, 0.8 * -1])
    np.testing.assert_allclose(loss, (W * per_token).sum(), rtol=1e-5)
    live = np.array([1, 1, 0, 1, 0])
    np.testing.assert_allclose(g, -W * ADV * RHO * live, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["clip_fraction"], 2 / 5)


def test_cispo_by_hand():
    # Defaults: no lower bound, weights clipped at 1 + 5 = 6 (token 2's rho = 12.18).
    (loss, m), g = _value_and_grad(lambda lp: losses.cispo(lp, MU, ADV, W, MASK))
    coef = np.array([np.exp(0.2), 1.0, 6.0, np.exp(-0.5), np.exp(-1.0)])
    np.testing.assert_allclose(loss, -(W * coef * ADV * LP).sum(), rtol=1e-5)
    np.testing.assert_allclose(loss, 0.61070 - 1.0 + 6.0 + 0.11372 - 0.5 * 0.36788 * 3, rtol=1e-4)
    np.testing.assert_allclose(g, -W * coef * ADV, rtol=1e-5)  # every token keeps a gradient
    np.testing.assert_allclose(m["clip_fraction"], 1 / 5)
    # A tight region: weights clip(rho, 0.8, 1.28); tokens 2, 3, 4 are clipped, yet unlike
    # PPO's, their gradients stay (weighted by the clipped value).
    (_, m), g = _value_and_grad(
        lambda lp: losses.cispo(lp, MU, ADV, W, MASK, eps_low=0.2, eps_high=0.28)
    )
    coef = np.array([np.exp(0.2), 1.0, 1.28, 0.8, 0.8])
    np.testing.assert_allclose(g, -W * coef * ADV, rtol=1e-5)
    np.testing.assert_allclose(m["clip_fraction"], 3 / 5)


def test_gspo_by_hand():
    lp, mu = LP[:4], MU[:4]
    adv = np.array([1.0, 1.0, 0.5, 0.5], np.float32)
    w, mask, seq = W[:4], MASK[:4], np.array([0, 0, 1, 1])
    (loss, m), g = _value_and_grad(
        lambda lp: losses.gspo(lp, mu, adv, w, mask, seq, 2, eps_low=0.2, eps_high=0.3), lp
    )
    s0 = np.exp(0.1)  # geometric mean of sequence 0's token ratios (sequence 1 is clipped)
    np.testing.assert_allclose(loss, -(w[:2].sum() * s0 * 1.0 + w[2:].sum() * 1.3 * 0.5), rtol=1e-5)
    np.testing.assert_allclose(g, [-w[0] * s0, -w[1] * s0, 0.0, 0.0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["clip_fraction"], 2 / 4)


def test_kl_and_entropy_terms_by_hand():
    ref = np.array([-1.1, -1.9, -0.7, -1.4, -2.5], np.float32)
    ent = jnp.array([2.0, 1.5, 0.3, 1.1, 0.9])

    def fn(lp, ent):
        return losses.tis_reinforce(
            lp, MU, ADV, W, MASK, entropy=ent, ref_logprobs=ref, kl_coef=0.1, entropy_coef=0.01
        )

    (loss, m), (g_lp, g_ent) = jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))(
        jnp.asarray(LP), ent
    )
    d = ref.astype(np.float64) - LP
    k3 = np.exp(d) - d - 1
    pg = -(W * np.minimum(RHO, 5) * ADV * LP).sum()
    np.testing.assert_allclose(loss, pg + 0.1 * (W * k3).sum() - 0.01 * (W * ent).sum(), rtol=1e-5)
    np.testing.assert_allclose(
        g_lp, -W * np.minimum(RHO, 5) * ADV + 0.1 * W * (1 - np.exp(d)), rtol=1e-5
    )
    np.testing.assert_allclose(g_ent, -0.01 * W, rtol=1e-6)
    np.testing.assert_allclose(m["kl_ref"], k3.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["entropy"], np.mean(ent), rtol=1e-6)
    np.testing.assert_allclose(m["pg_loss"], pg, rtol=1e-5)


def test_masked_tokens_do_not_count():
    mask = np.array([1, 1, 1, 1, 0], np.float32)
    w = W * mask
    (loss, m), g = _value_and_grad(lambda lp: losses.tis_reinforce(lp, MU, ADV, w, mask))
    assert g[4] == 0.0 and m["tokens"] == 4
    np.testing.assert_allclose(m["ratio_mean"], RHO[:4].mean(), rtol=1e-5)


@pytest.mark.parametrize("objective", ["tis_reinforce", "ppo", "gspo", "cispo"])
def test_on_policy_ratios_are_one_and_gradient_is_reinforce(objective):
    seq = np.array([0, 0, 1, 1, 2])

    def fn(lp):
        mu = jax.lax.stop_gradient(lp)  # the sampler's logprobs equal the trained policy's
        if objective == "gspo":
            return losses.gspo(lp, mu, ADV, W, MASK, seq, 3)
        return getattr(losses, objective)(lp, mu, ADV, W, MASK)

    (_, m), g = _value_and_grad(fn)
    assert float(m["ratio_mean"]) == 1.0 and float(m["ratio_max"]) == 1.0
    assert float(m["ess"]) == 1.0 and float(m["clip_fraction"]) == 0.0
    assert float(m["kl_new_old"]) == 0.0
    np.testing.assert_allclose(g, -W * ADV, rtol=1e-6)  # grad of -sum w * A * log pi


def _samples():
    rng = np.random.default_rng(1)
    out = []
    for i, (p, c) in enumerate([(2, 3), (1, 5), (3, 1), (2, 2), (1, 4)]):
        out.append(
            ScoredSample(
                rng.integers(0, 11, p).tolist(),
                rng.integers(0, 11, c).tolist(),
                (-rng.random(c) * 2).tolist(),
                [0] * c,
                float(rng.random()),
                i // 3,
            )
        )
    return out


@pytest.mark.parametrize(
    "weighting", ["sequence_sum", "token_mean", "group_token_mean", "sequence_mean"]
)
def test_weighting_modes_by_hand(weighting):
    cfg = BatchConfig(
        seq_len=8, num_rows=4, max_sequences=6, max_sequence_len=6, weighting=weighting
    )
    b, _ = build_batch(_samples(), cfg)
    lp = -np.random.default_rng(2).random(b.tokens.shape).astype(np.float32)
    idx, groups, n_seq = b.sequence_index, b.group_ids, 5

    def by_hand(lp):
        coef = jax.lax.stop_gradient(jnp.minimum(jnp.exp(lp - b.behaviour_logprobs), 5.0))
        per_tok = -coef * b.advantages * lp
        seq_sums = [jnp.sum(jnp.where(idx == i, per_tok, 0.0)) for i in range(n_seq)]
        lengths = [int((idx == i).sum()) for i in range(n_seq)]
        if weighting == "sequence_sum":
            return sum(seq_sums) / n_seq
        if weighting == "token_mean":
            return sum(seq_sums) / sum(lengths)
        if weighting == "sequence_mean":
            return sum(s / n for s, n in zip(seq_sums, lengths)) / n_seq
        per_group = []
        for g in (0, 1):
            members = [i for i in range(n_seq) if groups[i] == g]
            per_group.append(sum(seq_sums[i] for i in members) / sum(lengths[i] for i in members))
        return sum(per_group) / 2

    def ours(lp):
        mu = jax.lax.stop_gradient(jnp.asarray(b.behaviour_logprobs))
        lp_on_mask = jnp.where(b.loss_mask > 0, lp, 0.0)
        return losses.tis_reinforce(lp_on_mask, mu, b.advantages, b.token_weights, b.loss_mask)[0]

    (l1, g1), (l2, g2) = jax.jit(
        lambda lp: (jax.value_and_grad(ours)(lp), jax.value_and_grad(by_hand)(lp))
    )(lp)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    np.testing.assert_allclose(g1, g2 * b.loss_mask, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(token_chunk=7),
        LossConfig(objective="ppo", kl_coef=0.1, entropy_coef=0.01, token_chunk=5, temperature=0.7),
        LossConfig(
            objective="gspo",
            gspo_eps_low=0.2,
            gspo_eps_high=0.3,
            vocab_chunk=4,
            entropy_coef=0.02,
            kl_coef=0.05,
        ),
        LossConfig(objective="cispo", cispo_eps_high=0.5, token_chunk=3, kl_coef=0.1),
    ],
    ids=["tis", "ppo_kl_ent", "gspo_kl_ent", "cispo_kl"],
)
def test_loss_from_hidden_matches_public_objectives(cfg):
    batch_cfg = BatchConfig(seq_len=8, num_rows=4, max_sequences=6, max_sequence_len=6)
    b, _ = build_batch(_samples(), batch_cfg)
    k = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(k[0], b.tokens.shape + (8,))
    w = 0.3 * jax.random.normal(k[1], (8, 11))  # logprobs in the range of the sampler's
    ref = -jax.random.uniform(k[2], b.tokens.shape) * 3
    use_ref = cfg.kl_coef > 0
    kw = dict(kl_coef=cfg.kl_coef, entropy_coef=cfg.entropy_coef)

    def ours(h, w):
        loss, stats = losses.loss_from_hidden(
            cfg, h, w, b, ref_logprobs=ref if use_ref else None, num_sequences=6, **kw
        )
        return loss, losses.finalize(stats)

    def public(h, w):
        lp, ent = full_logprobs(h, w, b.targets, temperature=cfg.temperature)
        args = (lp, b.behaviour_logprobs, b.advantages, b.token_weights, b.loss_mask)
        extra = dict(entropy=ent, ref_logprobs=ref if use_ref else None, **kw)
        if cfg.objective == "gspo":
            return losses.gspo(*args, b.sequence_index, 6, eps_low=0.2, eps_high=0.3, **extra)
        if cfg.objective == "ppo":
            return losses.ppo(*args, **extra)
        if cfg.objective == "cispo":
            return losses.cispo(*args, eps_high=0.5, **extra)
        return losses.tis_reinforce(*args, **extra)

    grad = lambda f: jax.value_and_grad(f, (0, 1), has_aux=True)(h, w)
    ((l1, m1), g1), ((l2, m2), g2) = jax.jit(lambda h, w: (grad(ours), grad(public)))(h, w)
    np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-6)
    for key in m2:
        np.testing.assert_allclose(m1[key], m2[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for x, y in zip(g1, g2):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_accumulate_then_finalize_equals_whole():
    def both():
        half = lambda x, i: x[:3] if i == 0 else x[3:]
        stats = [
            losses.objective_stats(
                "tis_reinforce",
                half(LP, i),
                None,
                half(MU, i),
                half(ADV, i),
                half(W, i),
                half(MASK, i),
                clip=5.0,
                eps_low=0.0,
                eps_high=0.0,
                kl_coef=0.0,
                entropy_coef=0.0,
            )
            for i in (0, 1)
        ]
        return losses.finalize(losses.accumulate(*stats)), losses.tis_reinforce(
            LP, MU, ADV, W, MASK
        )[1]

    merged, whole = jax.jit(both)()
    for key in whole:
        np.testing.assert_allclose(merged[key], whole[key], rtol=1e-5, err_msg=key)


def test_lag_metrics_by_hand():
    versions = jnp.array([5, 4, 4, 1, 0])
    mask = jnp.array([1, 1, 1, 1, 0.0])
    m = lag.lag_metrics(versions, mask, 5)
    assert float(m["lag_mean"]) == 1.5 and int(m["lag_max"]) == 4
    assert int(m["lag_hist/0"]) == 1 and int(m["lag_hist/1"]) == 2
    assert int(m["lag_hist/4-5"]) == 1 and int(m["lag_hist/32+"]) == 0


def test_advantage_metrics_by_hand():
    m = losses.advantage_metrics(
        jnp.array([1.0, -1.0, 0.5, 9.0]), jnp.array([1.0, 0, 1, 7]), jnp.array([1.0, 1, 1, 0])
    )
    np.testing.assert_allclose(m["adv_mean"], 0.5 / 3, rtol=1e-6)
    assert float(m["adv_max"]) == 1.0 and float(m["adv_min"]) == -1.0
    np.testing.assert_allclose(m["reward_mean"], 2 / 3, rtol=1e-6)
