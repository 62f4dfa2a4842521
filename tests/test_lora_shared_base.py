"""One copy of a LoRA base on a shared device: the trainer reads the sampler's converted base
(models/shared_base.py) and steps exactly as it does with its own copy, in both sampler layouts,
with the KL reference, micro-batch accumulation and a bf16 model; its own copy is gone; the
stored base comes back bit for bit; what cannot be read exactly is refused in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, lora, shared_base
from pipelinerl_jax.rl.batch import build_batch
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.train import trainer as tr
from tests.test_trainer import samples, tiny_model

LORA = {"rank": 4, "alpha": 8, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}


def _pair(attention, micro_batches=1, loss=None, **model):
    """(trainer with its own base, trainer reading a sampler's base, sampler, params, batch)."""
    cfg = tiny_model(lora=LORA, **model)
    graphdef, params = decoder.init(cfg, jax.random.key(11))
    # Random B as well as A, so the adapters change the model from the first step.
    adapters, base = lora.split(decoder.arrays(params))
    keys = iter(jax.random.split(jax.random.key(12), 64))
    adapters = jax.tree.map(
        lambda x: 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), adapters
    )
    nnx.replace_by_pure_dict(params, lora.merge(adapters, base))
    tcfg = tr.TrainerConfig(
        learning_rate=3e-2,
        lr_schedule="constant",
        warmup_steps=0,
        micro_batches=micro_batches,
        loss=loss or LossConfig(objective="ppo", kl_coef=0.1),
    )
    trainers = [
        tr.Trainer(tcfg, graphdef, decoder.abstract_init(cfg)[1], tr.trainer_mesh())
        for _ in range(2)
    ]
    scfg = SamplerConfig(num_slots=2, max_seq_len=32, page_size=8, attention=attention)
    sampler = PagedSampler(graphdef, params, scfg)
    batch, _ = build_batch(
        samples([(3, 6), (4, 5), (2, 7), (3, 4)], seed=3),
        BatchConfig(seq_len=24, num_rows=2, max_sequences=4, max_sequence_len=12),
    )
    rng = np.random.default_rng(0)
    batch = batch.replace(advantages=rng.normal(size=batch.loss_mask.shape).astype(np.float32))
    return *trainers, sampler, graphdef, params, batch


@pytest.mark.parametrize(
    "attention,micro_batches,model",
    [
        ("staged", 1, {}),  # feature_major: every projection transposed to [O, I]
        ("staged", 2, {"tie_word_embeddings": True}),  # accumulated in a lax.scan; tied head
        # token_major (the view holds the stored shapes), bf16 with the sampler's f32 head
        ("paged", 1, dict(param_dtype="bfloat16", compute_dtype="bfloat16")),
    ],
)
def test_a_trainer_reading_the_sampler_base_steps_exactly_as_with_its_own(
    attention, micro_batches, model
):
    own, shared, sampler, graphdef, params, batch = _pair(attention, micro_batches, **model)
    _, base = lora.split(jax.tree.map(np.asarray, decoder.arrays(params)))
    states, metrics = [], []
    for i, trainer in enumerate((own, shared)):
        state = trainer.init_state(params)
        if i == 1:
            trainer.read_base(sampler.base_for_trainer())
        got = []
        for _ in range(2):
            state, m = trainer.train_step(state, batch)
            got.append(jax.device_get(m))
        states.append(jax.device_get(state.params))
        metrics.append(got)
    assert isinstance(shared.frozen, shared_base.SharedBase)
    for a, b in zip(*metrics):
        for key in ("loss", "grad_norm", "kl_ref"):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-6, abs=1e-9), key
    assert float(metrics[0][1]["kl_ref"]) > 0  # the reference term took part
    # The staged view holds each projection transposed ([O, I]): its dots may sum in another
    # order, and two Adam steps (lr 3e-2) carry that rounding to ~1e-7 in the adapters.
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6), *states)
    # The trainer holds no base of its own: its layers are the sampler's arrays themselves.
    layout_layer = sampler.params["layers"][0]
    assert shared.frozen.layers[0]["q_proj"] is layout_layer["q_proj"]
    if model.get("tie_word_embeddings"):  # one f32 table serves as embedding and head
        assert sampler.params["head_VxE"] is sampler.params["embed"]
    # The stored base comes back bit for bit (an export, an evaluation without a sampler).
    stored = jax.device_get(shared_base.stored(shared.frozen))
    jax.tree.map(np.testing.assert_array_equal, stored, base)


def test_full_params_and_the_forward_under_grad_of_jit():
    own, shared, sampler, graphdef, params, batch = _pair("staged")
    shared.init_state(params)
    shared.read_base(sampler.base_for_trainer())
    adapters, base = lora.split(decoder.arrays(params))
    # full_params copies the shared base back to stored params joined to the adapters.
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(shared.full_params(adapters)),
        jax.device_get(lora.merge(adapters, base)),
    )

    def loss(a, b):
        p = shared_base.join(a, b)
        logits = decoder.forward(graphdef, p, batch.tokens, batch.positions, batch.segment_ids)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    g_shared = jax.grad(jax.jit(loss))(adapters, shared.frozen)
    g_own = jax.grad(jax.jit(loss))(adapters, base)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), g_shared, g_own
    )
    # Under jax.checkpoint too (what remat wraps around each layer).
    g_remat = jax.grad(jax.jit(jax.checkpoint(loss)))(adapters, shared.frozen)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), g_remat, g_own
    )


def test_what_cannot_be_read_exactly_is_refused():
    # A bf16 compute copy of an f32 base is not the base.
    own, _, sampler, _, params, _ = _pair("paged", compute_dtype="bfloat16")
    with pytest.raises(ConfigError, match="compute_dtype=bfloat16.*param_dtype=float32"):
        sampler.base_for_trainer()
    own2, shared, sampler2, _, params2, _ = _pair("paged")
    with pytest.raises(ConfigError, match="init_state first"):
        shared.read_base(sampler2.base_for_trainer())
    shared.init_state(params2)
    shared.read_base(sampler2.base_for_trainer())
    with pytest.raises(ConfigError, match="already reads a shared base"):
        shared.read_base(sampler2.base_for_trainer())
