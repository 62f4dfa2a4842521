"""The objective registry (rl/objectives.py): built-ins through it, custom objectives in it.

Built-in entries give the public objectives of rl/losses.py and hand-written formulas; a
registered custom objective is accepted by LossConfig and trained through loss_from_hidden's
fused head path (or, with sequence_ratio=True, the unfused one) with the same loss, metrics and
gradients as the same math on whole-vocabulary logprobs under plain jax.grad. All inputs are
fresh random arrays.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rl import losses, objectives
from pipelinerl_jax.rl.batch import ScoredSample, build_batch
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.rl.logprobs import full_logprobs
from pipelinerl_jax.rl.objectives import OBJECTIVES

N, S = 12, 3  # tokens, sequences
sg = jax.lax.stop_gradient


def _tokens(seed):
    """Random per-token inputs: logprobs, behaviour logprobs, advantages, weights, mask, index."""
    k = jax.random.split(jax.random.key(seed), 6)
    mask_N = (jax.random.uniform(k[0], (N,)) < 0.8).astype(jnp.float32)
    return dict(
        lp_N=-jax.random.uniform(k[1], (N,), minval=0.2, maxval=3.0),
        mu_N=mask_N * -jax.random.uniform(k[2], (N,), minval=0.2, maxval=3.0),
        adv_N=mask_N * jax.random.normal(k[3], (N,)),
        w_N=mask_N * jax.random.uniform(k[4], (N,), minval=0.1, maxval=1.0),
        mask_N=mask_N,
        seq_N=jnp.where(mask_N > 0, jax.random.randint(k[5], (N,), 0, S), S),
    )


def _hand_clip(ratio, adv, eps_low, eps_high):
    return -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_builtin_through_registry_equals_public_function_and_hand_math(name):
    x = _tokens(seed=OBJECTIVES.index(name))
    assert objectives.registered_objectives()[: len(OBJECTIVES)] == OBJECTIVES
    entry = objectives.get_objective(name)
    assert entry.sequence_ratio == (name == "gspo") and LossConfig(objective=name).fused != (
        name == "gspo"
    )
    options = dict(
        tis_reinforce=dict(clip=1.3),
        ppo=dict(eps_low=0.1, eps_high=0.15),
        gspo=dict(eps_low=0.05, eps_high=0.07),
        cispo=dict(eps_low=0.1, eps_high=0.2),
    )[name]
    args = (x["mu_N"], x["adv_N"], x["w_N"], x["mask_N"])

    def through_registry(lp):
        s = None
        if entry.sequence_ratio:
            s = losses.sequence_ratio(lp, x["mu_N"], x["mask_N"], x["seq_N"], S)
        ctx = objectives.TokenContext(x["mu_N"], x["adv_N"], s)
        return jnp.sum(x["w_N"] * entry(lp, ctx, **options)[0])

    def public(lp):
        if name == "gspo":
            return losses.gspo(lp, *args, x["seq_N"], S, **options)[0]
        return getattr(losses, name)(lp, *args, **options)[0]

    def by_hand(lp):
        mu, adv, w = x["mu_N"], x["adv_N"], x["w_N"]
        if name == "tis_reinforce":
            return jnp.sum(w * -sg(jnp.minimum(jnp.exp(lp - mu), 1.3)) * adv * lp)
        if name == "ppo":
            return jnp.sum(w * _hand_clip(jnp.exp(lp - mu), adv, 0.1, 0.15))
        if name == "cispo":  # the clipped weight, stop-gradient, times A log pi
            return jnp.sum(w * -sg(jnp.clip(jnp.exp(lp - mu), 0.9, 1.2)) * adv * lp)
        # gspo: each token's ratio is its sequence's geometric-mean ratio (stop-gradient) in
        # the token form s * pi/sg(pi), whose gradient is s * grad log pi.
        log_ratio = jnp.where(x["mask_N"] > 0, lp - mu, 0.0)
        s_N = jnp.ones(N)
        for i in range(S):
            on = x["seq_N"] == i
            mean = jnp.sum(jnp.where(on, log_ratio, 0.0)) / jnp.maximum(jnp.sum(on), 1)
            s_N = jnp.where(on, jnp.exp(mean), s_N)
        return jnp.sum(w * _hand_clip(sg(s_N) * jnp.exp(lp - sg(lp)), adv, 0.05, 0.07))

    fns = (through_registry, public, by_hand)
    results = jax.jit(lambda lp: [jax.value_and_grad(f)(lp) for f in fns])(x["lp_N"])
    (l0, g0), *others = results
    for loss, grad in others:
        np.testing.assert_allclose(l0, loss, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g0, grad, rtol=1e-5, atol=1e-6)
    # The generic entry point with the same options is the public function.
    generic, metrics = losses.objective_loss(name, x["lp_N"], *args, x["seq_N"], S, **options)
    np.testing.assert_allclose(generic, l0, rtol=1e-6)
    assert set(metrics) >= {"loss", "clip_fraction", "ess", "kl_new_old", "entropy"}


def test_unknown_objective_is_a_config_error_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=r"'nope' is not a registered objective.*'ppo'"):
        LossConfig(objective="nope")
    with pytest.raises(ConfigError, match="not a registered objective"):
        objectives.get_objective("nope")


def test_registration_errors():
    with pytest.raises(ConfigError, match="built-ins cannot be replaced"):
        objectives.register_objective("ppo", lambda lp, ctx: lp, replace=True)
    objectives.register_objective("bad_opts", lambda lp, ctx, c: lp, options={"c": "nope"})
    try:  # the fields are checked once a config selects it
        with pytest.raises(ConfigError, match=r"'bad_opts': options name \['nope'\], not LossC"):
            LossConfig(objective="bad_opts")
    finally:
        objectives.unregister_objective("bad_opts")
    with pytest.raises(ConfigError, match="built-in"):
        objectives.unregister_objective("gspo")
    objectives.register_objective("dup_test", lambda lp, ctx: -lp)
    try:
        with pytest.raises(ConfigError, match="already registered"):
            objectives.register_objective("dup_test", lambda lp, ctx: lp)
        objectives.register_objective("dup_test", lambda lp, ctx: lp, replace=True)
        assert "dup_test" in objectives.registered_objectives()
    finally:
        objectives.unregister_objective("dup_test")
    assert "dup_test" not in objectives.registered_objectives()
    with pytest.raises(TypeError, match="takes options"):
        losses.objective_loss("ppo", *[jnp.ones(3)] * 5, clip=2.0)


# A custom per-token objective: REINFORCE with a two-sided truncated weight and a tanh-squashed
# advantage; its clip option comes from the config's tis_clip, its floor is its own constant.
FLOOR = 0.3


def squashed_reinforce(logprobs_N, ctx, *, clip):
    ratio_N = jnp.exp(logprobs_N - ctx.behaviour_logprobs)
    coef_N = sg(jnp.clip(ratio_N, FLOOR, clip))
    return -coef_N * jnp.tanh(ctx.advantages) * logprobs_N, (ratio_N > clip) | (ratio_N < FLOOR)


def squashed_by_hand(lp, mu, adv, clip):
    ratio = jnp.exp(lp - mu)
    return -sg(jnp.clip(ratio, FLOOR, clip)) * jnp.tanh(adv) * lp, (ratio > clip) | (ratio < FLOOR)


# A custom sequence-level objective: each token weighted by its sequence's ratio.
def sequence_weighted(logprobs_N, ctx):
    return -ctx.sequence_ratio * ctx.advantages * logprobs_N


@pytest.fixture
def custom_objectives():
    objectives.register_objective("test_squashed", squashed_reinforce, options={"clip": "tis_clip"})
    objectives.register_objective("test_seq_weighted", sequence_weighted, sequence_ratio=True)
    yield
    objectives.unregister_objective("test_squashed")
    objectives.unregister_objective("test_seq_weighted")


def _samples(seed):
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, c) in enumerate([(2, 4), (1, 5), (3, 2), (2, 3), (1, 6)]):
        out.append(
            ScoredSample(
                rng.integers(0, 11, p).tolist(),
                rng.integers(0, 11, c).tolist(),
                (-rng.random(c) * 2 - 1).tolist(),
                [0] * c,
                float(rng.random()),
                i // 3,
            )
        )
    return out


@pytest.mark.parametrize("name", ["test_squashed", "test_seq_weighted"])
def test_custom_objective_through_loss_from_hidden_equals_hand_math(custom_objectives, name):
    cfg = LossConfig(
        objective=name, tis_clip=1.5, kl_coef=0.07, entropy_coef=0.03, token_chunk=5, vocab_chunk=4
    )
    assert cfg.fused == (name == "test_squashed")  # per-token: fused; sequence ratio: not
    b, _ = build_batch(
        _samples(seed=4), BatchConfig(seq_len=8, num_rows=5, max_sequences=6, max_sequence_len=7)
    )
    k = jax.random.split(jax.random.key(8), 3)
    h = jax.random.normal(k[0], b.tokens.shape + (8,))
    w = 0.4 * jax.random.normal(k[1], (8, 11))
    ref = -jax.random.uniform(k[2], b.tokens.shape, minval=1.0, maxval=3.0)
    mu, adv, tw, m = b.behaviour_logprobs, b.advantages, b.token_weights, b.loss_mask

    def ours(h, w):
        loss, stats = losses.loss_from_hidden(
            cfg, h, w, b, kl_coef=0.07, entropy_coef=0.03, ref_logprobs=ref, num_sequences=6
        )
        return loss, losses.finalize(stats)

    def by_hand(h, w):
        lp, ent = full_logprobs(h, w, b.targets)
        if name == "test_squashed":
            pg, flag = squashed_by_hand(lp, mu, adv, 1.5)
        else:
            s = sg(losses.sequence_ratio(lp, mu, m, b.sequence_index, 6))
            pg, flag = -s * adv * lp, jnp.zeros(lp.shape, bool)
        d = ref - lp
        k3 = jnp.exp(d) - d - 1
        loss = jnp.sum(tw * (pg + 0.07 * k3 - 0.03 * ent))
        n = jnp.sum(m)
        return loss, {
            "clip_fraction": jnp.sum(jnp.where((m > 0) & flag, 1.0, 0.0)) / n,
            "kl_ref": jnp.sum(m * sg(k3)) / n,
            "entropy": jnp.sum(m * sg(ent)) / n,
            "pg_loss": jnp.sum(tw * sg(pg)),
        }

    grad = lambda f: jax.value_and_grad(f, (0, 1), has_aux=True)(h, w)
    ((l1, m1), g1), ((l2, m2), g2) = jax.jit(lambda h, w: (grad(ours), grad(by_hand)))(h, w)
    np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m1["loss"], l2, rtol=1e-5, atol=1e-6)
    for key in m2:
        np.testing.assert_allclose(m1[key], m2[key], rtol=1e-5, atol=1e-6, err_msg=key)
    if name == "test_squashed":
        assert 0 < float(m1["clip_fraction"]) < 1  # the flag reaches the metric
    for a, c in zip(g1, g2):
        assert float(jnp.abs(c).max()) > 1e-3
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)
