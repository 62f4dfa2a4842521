"""Trainer(loss_fn=, optimizer=, rules=): each hook against plain jax.grad of the same math.

With optimizer=optax.sgd(lr) and no clipping one step moves the params by exactly -lr * grad,
so the step's gradient can be read off the params and compared with jax.grad of a loss written
by hand: a registered custom objective (through the fused head path), a loss_fn wrapping
default_loss_fn, and a loss_fn(params, batch) written from scratch, accumulated over
micro-batches. A mesh whose axes the rules do not name is a ConfigError. Tiny random model,
random batch (random rewards, behaviour logprobs and reference params: nothing is zero).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipelinerl_jax import sharding
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder
from pipelinerl_jax.rl import objectives
from pipelinerl_jax.rl.batch import build_batch
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.train import trainer as tr
from tests.test_trainer import samples, tiny_model

LR = 0.5
sg = jax.lax.stop_gradient


@pytest.fixture(scope="module")
def model_and_batch():
    cfg = tiny_model(num_layers=1)
    graphdef, params = decoder.init(cfg, jax.random.key(21))
    _, ref_params = decoder.init(cfg, jax.random.key(22))  # a reference unlike the policy: KL > 0
    data = samples([(3, 6), (4, 5), (2, 7), (3, 4)], seed=23)
    batch, _ = build_batch(
        data, BatchConfig(seq_len=16, num_rows=4, max_sequences=4, max_sequence_len=12)
    )
    return cfg, graphdef, params, ref_params, batch


def _tcfg(**loss):
    return tr.TrainerConfig(
        learning_rate=1.0,  # unused: the optimizer is given
        grad_clip_norm=0.0,  # so the update is exactly -lr * grad
        attention_block=0,
        loss=LossConfig(**loss),
    )


def _one_sgd_step(trainer, params, ref_params, batch):
    """(params after one step, metrics) as numpy."""
    state, metrics = trainer.train_step(trainer.init_state(params, ref_params), batch)
    return jax.device_get(state.params), jax.device_get(metrics)


def _check_update(before, after, grads):
    """after - before == -LR * grads, leaf by leaf, and the gradient is not trivially zero."""
    leaves = zip(jax.tree.leaves(before), jax.tree.leaves(after), jax.tree.leaves(grads))
    for b, a, g in leaves:
        # atol: the f32 rounding of b + update, up to an ulp of the param (norm scales are ~1).
        atol = 1.2e-7 * float(np.abs(b).max())
        np.testing.assert_allclose(np.asarray(a) - np.asarray(b), -LR * g, rtol=2e-4, atol=atol)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-3


def _token_logprobs(graphdef, params, batch):
    """Target logprobs and entropies [R, T] from whole-vocabulary logits."""
    logits = decoder.forward(
        graphdef, params, batch.tokens, batch.positions, batch.segment_ids, batch.prefix_ids
    )
    logp = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.take_along_axis(logp, batch.targets[..., None], axis=-1)[..., 0]
    return lp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def clipped_advantage_reinforce(logprobs, ctx, *, clip):
    """A custom per-token objective: truncated IS with the advantage clipped to [-1, 1]."""
    ratio = jnp.exp(logprobs - ctx.behaviour_logprobs)
    coef = sg(jnp.minimum(ratio, clip))
    return -coef * jnp.clip(ctx.advantages, -1.0, 1.0) * logprobs, ratio > clip


@pytest.fixture
def custom_objective():
    objectives.register_objective(
        "test_api_clipped_adv", clipped_advantage_reinforce, options={"clip": "tis_clip"}
    )
    yield "test_api_clipped_adv"
    objectives.unregister_objective("test_api_clipped_adv")


def test_custom_objective_and_sgd_step_equal_hand_gradient(model_and_batch, custom_objective):
    cfg, graphdef, params, ref_params, batch = model_and_batch
    loss_kw = dict(objective=custom_objective, tis_clip=1.2, kl_coef=0.1, entropy_coef=0.05)
    tcfg = _tcfg(**loss_kw)
    trainer = tr.Trainer(
        tcfg, graphdef, decoder.abstract_init(cfg)[1], tr.trainer_mesh(), optimizer=optax.sgd(LR)
    )
    after, metrics = _one_sgd_step(trainer, params, ref_params, batch)

    def by_hand(p):
        lp, ent = _token_logprobs(graphdef, p, batch)
        ref_lp = sg(_token_logprobs(graphdef, ref_params, batch)[0])
        ratio = jnp.exp(lp - batch.behaviour_logprobs)
        adv = jnp.clip(batch.advantages, -1.0, 1.0)
        pg = -sg(jnp.minimum(ratio, 1.2)) * adv * lp
        k3 = jnp.exp(ref_lp - lp) - (ref_lp - lp) - 1.0
        return jnp.sum(batch.token_weights * (pg + 0.1 * k3 - 0.05 * ent))

    loss, grads = jax.jit(jax.value_and_grad(by_hand))(params)
    _check_update(params, after, grads)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    assert float(metrics["kl_ref"]) > 0 and 0 < float(metrics["clip_fraction"]) < 1
    assert "lr" not in metrics  # plain optax.sgd keeps no learning rate in its state


def test_loss_fn_hook_wrapping_the_default(model_and_batch):
    cfg, graphdef, params, ref_params, batch = model_and_batch

    def l2(params):
        return 1e-2 * sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(params))

    tcfg = _tcfg(objective="ppo", ppo_eps_low=0.1, ppo_eps_high=0.1)
    base = tr.default_loss_fn(tcfg, graphdef)

    def with_l2(params, batch):
        loss, aux = base(params, batch)
        extra = l2(params)
        return loss + extra, {**aux, "loss": aux["loss"] + extra, "l2": extra}

    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=LR)
    trainer = tr.Trainer(
        tcfg,
        graphdef,
        decoder.abstract_init(cfg)[1],
        tr.trainer_mesh(),
        loss_fn=with_l2,
        optimizer=optimizer,
    )
    after, metrics = _one_sgd_step(trainer, params, None, batch)

    def reference(p):
        kw = dict(
            graphdef=graphdef,
            loss_cfg=tcfg.loss,
            kl_coef=0.0,
            entropy_coef=0.0,
            attention_block=0,
        )
        return tr.rl_loss(p, None, batch, **kw)[0] + l2(p)

    loss, grads = jax.jit(jax.value_and_grad(reference))(params)
    _check_update(params, after, grads)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["l2"], l2(params), rtol=1e-6)
    assert float(metrics["lr"]) == LR  # read from inject_hyperparams' state
    assert "clip_fraction" in metrics and "ess" in metrics


def test_a_loss_written_from_scratch_over_micro_batches(model_and_batch):
    """loss_fn(params, batch) -> (loss, aux): an advantage-weighted token loss of the
    researcher's own, from the model's logits. With 2 micro-batches the step's gradient and
    aux sums are those of the whole batch."""
    cfg, graphdef, params, _, batch = model_and_batch

    def loss_fn(params, batch):
        lp, _ = _token_logprobs(graphdef, params, batch)
        per_token = -batch.token_weights * batch.advantages * lp
        return jnp.sum(per_token), {"tokens": jnp.sum(batch.loss_mask)}

    tcfg = dataclasses.replace(_tcfg(), micro_batches=2)
    trainer = tr.Trainer(
        tcfg,
        graphdef,
        decoder.abstract_init(cfg)[1],
        tr.trainer_mesh(),
        loss_fn=loss_fn,
        optimizer=optax.sgd(LR),
    )
    after, metrics = _one_sgd_step(trainer, params, None, batch)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch)[0]))(params)
    _check_update(params, after, grads)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    assert float(metrics["tokens"]) == float(jnp.sum(batch.loss_mask)) > 0


def test_loss_fn_must_return_loss_and_aux(model_and_batch):
    cfg, graphdef, params, _, batch = model_and_batch
    trainer = tr.Trainer(
        _tcfg(),
        graphdef,
        decoder.abstract_init(cfg)[1],
        tr.trainer_mesh(),
        loss_fn=lambda p, b: jnp.sum(b.advantages),
    )
    with pytest.raises(TypeError, match=r"must return \(loss, aux_dict\)"):
        trainer.train_step(trainer.init_state(params), batch)


def test_default_loss_fn_with_a_kl_term_needs_the_reference(model_and_batch):
    _, graphdef, *_ = model_and_batch
    with pytest.raises(ConfigError, match="pass ref_params"):
        tr.default_loss_fn(_tcfg(kl_coef=0.1), graphdef)


def test_mesh_axes_must_be_known_to_the_rules(model_and_batch):
    cfg, graphdef, *_ = model_and_batch
    abstract = decoder.abstract_init(cfg)[1]
    mesh = sharding.make_mesh((1, 1), ("data", "model"), jax.devices()[:1])
    with pytest.raises(
        ConfigError,
        match=r"mesh axes \['data', 'model'\] are unknown .*known axes: \['tp', 'fsdp'\]",
    ):
        tr.Trainer(tr.TrainerConfig(), graphdef, abstract, mesh)
    partly = sharding.make_mesh((1, 1), ("fsdp", "model"), jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"mesh axes \['model'\] are unknown"):
        tr.Trainer(tr.TrainerConfig(), graphdef, abstract, partly)
    rules = (("embed", "data"), ("mlp", "model"), ("batch", "data"))
    trainer = tr.Trainer(tr.TrainerConfig(), graphdef, abstract, mesh, rules=rules)
    assert trainer.batch_axis == "data" and trainer.rules == rules


def test_bad_hooks_and_mesh_shapes(model_and_batch):
    cfg, graphdef, *_ = model_and_batch
    abstract = decoder.abstract_init(cfg)[1]
    with pytest.raises(TypeError, match="GradientTransformation"):
        tr.Trainer(tr.TrainerConfig(), graphdef, abstract, tr.trainer_mesh(), optimizer=0.1)
    with pytest.raises(TypeError, match="callable"):
        tr.Trainer(tr.TrainerConfig(), graphdef, abstract, tr.trainer_mesh(), loss_fn="ppo")
    with pytest.raises(ConfigError, match=r"needs 4 devices, got 1"):
        sharding.make_mesh((2, 2), ("fsdp", "tp"), jax.devices()[:1])
    mesh = tr.trainer_mesh()
    assert mesh.axis_names == ("fsdp", "tp")
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2


def test_lower_gives_the_step_program_without_running_it(model_and_batch):
    """Trainer.lower: XLA's buffer assignment and program of the step, from arrays or from
    shapes alone; the state is neither run nor donated."""
    cfg, graphdef, params, _, batch = model_and_batch
    trainer = tr.Trainer(
        tr.TrainerConfig(), graphdef, decoder.abstract_init(cfg)[1], tr.trainer_mesh()
    )
    state = trainer.init_state(params)
    compiled = trainer.lower(state, batch).compile()
    assert compiled.memory_analysis().temp_size_in_bytes > 0
    assert "dot" in compiled.as_text()
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        (state, trainer.put_batch(batch)),
    )
    assert trainer.lower(*shapes).as_text() == trainer.lower(state, batch).as_text()
    assert int(state.step) == 0 and not any(x.is_deleted() for x in jax.tree.leaves(state))
    trainer.train_step(state, batch)  # still usable
