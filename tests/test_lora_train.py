"""The train step with LoRA (model.lora): only the adapters learn, their moments are the only
optimizer state, the base stays bit-identical, the KL reference is the base, and micro-batch
accumulation gives the one-batch gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, lora
from pipelinerl_jax.rl.batch import build_batch
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.train import trainer as tr
from tests.test_trainer import samples, tiny_model

LORA = {"rank": 4, "alpha": 8, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}


def _setup(micro_batches=1, loss=None, lr=1e-2, seed=5):
    cfg = tiny_model(lora=LORA)
    graphdef, params = decoder.init(cfg, jax.random.key(seed))
    tcfg = tr.TrainerConfig(
        learning_rate=lr,
        lr_schedule="constant",
        warmup_steps=0,
        weight_decay=0.0,
        micro_batches=micro_batches,
        loss=loss or LossConfig(),
    )
    trainer = tr.Trainer(tcfg, graphdef, decoder.abstract_init(cfg)[1], tr.trainer_mesh())
    batch, _ = build_batch(
        samples([(3, 6), (4, 5), (2, 7), (3, 4)], seed=3),
        BatchConfig(seq_len=24, num_rows=2, max_sequences=4, max_sequence_len=12),
    )
    return cfg, graphdef, params, trainer, batch.replace(advantages=batch.loss_mask.copy())


def _target_logprob(graphdef, params, batch):
    logits = decoder.jit_forward(graphdef, params, batch.tokens, batch.positions, batch.segment_ids)
    lp = jax.nn.log_softmax(logits, axis=-1)
    lp = np.take_along_axis(np.asarray(lp), batch.targets[..., None], axis=-1)[..., 0]
    return float((lp * batch.loss_mask).sum() / batch.loss_mask.sum())


def test_only_adapters_train_and_the_base_stays_bit_identical():
    cfg, graphdef, params, trainer, batch = _setup()
    _, base_before = lora.split(jax.tree.map(np.asarray, decoder.arrays(params)))
    state = trainer.init_state(params)
    assert set(state.params["layers"]) == {
        f"{t}{s}" for t in lora.TARGETS for s in (lora.SUFFIX_A, lora.SUFFIX_B)
    }
    # The optimizer state holds adapter-sized moments only.
    moment_sizes = {x.size for x in jax.tree.leaves(state.opt_state) if x.ndim}
    adapter_sizes = {x.size for x in jax.tree.leaves(state.params)}
    assert moment_sizes <= adapter_sizes
    before = _target_logprob(graphdef, params, batch)
    for _ in range(3):
        state, metrics = trainer.train_step(state, batch)
    assert int(state.version) == 3 and np.isfinite(float(metrics["loss"]))
    after = _target_logprob(graphdef, trainer.full_params(state.params), batch)
    assert after > before + 0.05, (before, after)
    jax.tree.map(np.testing.assert_array_equal, decoder.arrays(trainer.frozen), base_before)
    # B moved off zero: the adapters are what changed the model.
    assert float(jnp.abs(state.params["layers"]["q_proj_lora_b"]).max()) > 0


def test_micro_batches_give_the_one_batch_step():
    results = []
    for m in (1, 2):
        _, _, params, trainer, batch = _setup(micro_batches=m)
        state = trainer.init_state(params)
        state, metrics = trainer.train_step(state, batch)
        results.append((jax.device_get(state.params), float(metrics["grad_norm"])))
    (p1, g1), (p2, g2) = results
    assert g1 == pytest.approx(g2, rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), p1, p2)


def test_kl_reference_is_the_base_model():
    loss = LossConfig(objective="ppo", kl_coef=0.1)
    _, graphdef, params, trainer, batch = _setup(loss=loss, lr=3e-2)
    state = trainer.init_state(params)
    assert state.ref_params is None  # no copy of the model for the reference
    kls = []
    for _ in range(3):
        state, metrics = trainer.train_step(state, batch)
        kls.append(float(metrics["kl_ref"]))
    assert kls[0] == pytest.approx(0.0, abs=1e-6)  # B = 0: the policy is the base
    assert kls[2] > 1e-6
    with pytest.raises(ConfigError, match="KL reference is the frozen base"):
        trainer.init_state(params, ref_params=params)


def test_step_before_init_state_is_refused():
    _, _, _, trainer, batch = _setup()
    with pytest.raises(ConfigError, match="call init_state first"):
        trainer.train_step(None, batch)


def test_a_bf16_base_keeps_f32_adapters_and_moments():
    cfg = tiny_model(lora=LORA, param_dtype="bfloat16", compute_dtype="bfloat16")
    graphdef, params = decoder.init(cfg, jax.random.key(1))
    adapters, base = lora.split(decoder.arrays(params))
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    trainer = tr.Trainer(
        tr.TrainerConfig(learning_rate=1e-2, warmup_steps=0),
        graphdef,
        decoder.abstract_init(cfg)[1],
        tr.trainer_mesh(),
    )
    batch, _ = build_batch(
        samples([(3, 6), (4, 5)], seed=3),
        BatchConfig(seq_len=24, num_rows=2, max_sequences=4, max_sequence_len=12),
    )
    state = trainer.init_state(params)
    for _ in range(2):
        state, metrics = trainer.train_step(state, batch)
    assert np.isfinite(float(metrics["loss"])) and int(state.version) == 2
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    jax.tree.map(np.testing.assert_array_equal, decoder.arrays(trainer.frozen), base)
