"""The train step on one device: packing invariance, learning, NaN skipping, bf16 params."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import attention, decoder
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.rl.batch import ScoredSample, build_batch
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.train import trainer as tr

VOCAB = 64


def tiny_model(**overrides) -> ModelConfig:
    fields = dict(
        model_type="qwen2",
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=True,
        qk_norm=False,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def samples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, c) in enumerate(lengths):
        out.append(
            ScoredSample(
                rng.integers(0, VOCAB, p).tolist(),
                rng.integers(0, VOCAB, c).tolist(),
                (-rng.random(c) * 2 - 3).tolist(),
                rng.integers(0, 3, c).tolist(),
                float(rng.random()),
                i // 2,
            )
        )
    return out


def two_losses_and_grads(graphdef, params, batch_a, block_a, batch_b, block_b):
    """((loss, stats), grads) of the trainer's loss on two batches, in one jit; block_* is the
    trainer's attention_block (0: the model's plain segment attention)."""

    def value_and_grad(batch, block):
        fn = lambda p: tr.rl_loss(
            p,
            None,
            batch,
            graphdef=graphdef,
            loss_cfg=LossConfig(),
            kl_coef=0.0,
            entropy_coef=0.0,
            attention_block=block,
        )
        return jax.value_and_grad(fn, has_aux=True)(params)

    return jax.jit(lambda a, b: (value_and_grad(a, block_a), value_and_grad(b, block_b)))(
        batch_a, batch_b
    )


def test_blocked_attention_matches_model_attention():
    k = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k[0], (2, 15, 4, 8))
    kv = jax.random.normal(k[1], (2, 15, 2, 8))
    v = jax.random.normal(k[2], (2, 15, 2, 8))
    seg = jnp.array([[1] * 6 + [2] * 7 + [0] * 2, [1] * 15])
    blocked, plain = jax.jit(
        lambda q, kv, v, seg: (
            attention.blocked_causal_attention(seg, 4)(q, kv, v, None)[0],
            attention.segment_causal_attention(seg)(q, kv, v, None)[0],
        )
    )(q, kv, v, seg)
    np.testing.assert_allclose(blocked, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_prefix", [False, True])
def test_blocked_attention_gradients_match_autodiff_of_model_attention(with_prefix):
    """The blocked attention's hand-written VJP against autodiff of the plain masked attention:
    packed segments, padding, a shared-prompt prefix, blocks that do not divide T, grad of jit
    and through jax.checkpoint."""
    k = jax.random.split(jax.random.key(5), 4)
    q = jax.random.normal(k[0], (2, 15, 4, 8))
    kv = jax.random.normal(k[1], (2, 15, 2, 8))
    v = jax.random.normal(k[2], (2, 15, 2, 8))
    r = jax.random.normal(k[3], (2, 15, 4, 8))
    seg = jnp.array([[1] * 6 + [2] * 4 + [3] * 3 + [0] * 2, [1] * 15])
    prefix = jnp.array([[-1] * 6 + [1] * 7 + [-1] * 2, [-1] * 15]) if with_prefix else None

    def loss(make):
        return lambda q, kv, v: jnp.sum(make(seg, prefix)(q, kv, v, None)[0] * r)

    blocked = loss(lambda s, p: attention.blocked_causal_attention(s, 4, p))
    plain = loss(attention.segment_causal_attention)
    # The reference under jit: op by op, each of its many small ops compiled on its own, it
    # took seconds longer than the checks themselves.
    want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(q, kv, v)
    for got in (
        jax.value_and_grad(jax.jit(blocked), argnums=(0, 1, 2))(q, kv, v),
        jax.jit(jax.value_and_grad(jax.checkpoint(blocked), argnums=(0, 1, 2)))(q, kv, v),
    ):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
        for g, w in zip(got[1], want[1], strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_blocked_attention_bf16_gradients_stay_bf16_and_close_to_f32():
    k = jax.random.split(jax.random.key(6), 4)
    q = jax.random.normal(k[0], (2, 12, 4, 8))
    kv = jax.random.normal(k[1], (2, 12, 2, 8))
    v = jax.random.normal(k[2], (2, 12, 2, 8))
    r = jax.random.normal(k[3], (2, 12, 4, 8))
    seg = jnp.array([[1] * 7 + [2] * 5, [1] * 12])
    attend = attention.blocked_causal_attention(seg, 5)

    def loss(q, kv, v):
        return jnp.sum(attend(q, kv, v, None)[0].astype(jnp.float32) * r)

    bf = tuple(x.astype(jnp.bfloat16) for x in (q, kv, v))
    # Under jit, as the train step runs it: op by op, each of the unrolled blocks' many small
    # ops compiled on its own, it took ~10 s (the gradients are the same bits either way).
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    got = grad(*bf)
    want = grad(*(x.astype(jnp.float32) for x in bf))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(g.astype(jnp.float32), w, rtol=0.05, atol=0.05)


def test_packed_rows_equal_unpacked_loss_and_grads():
    cfg = tiny_model()
    graphdef, params = decoder.init(cfg, jax.random.key(1))
    data = samples([(3, 7), (5, 5), (4, 8), (2, 9)])  # 10-12 tokens each
    # Rows of 12: one sample per row. Rows of 24: two per row, attention in blocks of 5.
    unpacked, _ = build_batch(
        data, BatchConfig(seq_len=12, num_rows=4, max_sequences=4, max_sequence_len=12)
    )
    packed, _ = build_batch(
        data, BatchConfig(seq_len=24, num_rows=2, max_sequences=4, max_sequence_len=12)
    )
    assert (packed.segment_ids.max(axis=1) == 2).all()

    ((l1, s1), g1), ((l2, s2), g2) = two_losses_and_grads(graphdef, params, unpacked, 0, packed, 5)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    assert float(s1["tokens"]) == float(s2["tokens"]) == 29
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


@pytest.fixture(scope="module")
def f32_trainer():
    cfg = tiny_model()
    graphdef, params = decoder.init(cfg, jax.random.key(2))
    tcfg = tr.TrainerConfig(
        learning_rate=1e-2,
        lr_schedule="constant",
        warmup_steps=0,
        grad_clip_norm=1.0,
        weight_decay=0.0,
        max_consecutive_skips=2,
    )
    trainer = tr.Trainer(tcfg, graphdef, decoder.abstract_init(cfg)[1], tr.trainer_mesh())
    data = samples([(3, 6), (4, 5), (2, 7), (3, 4)], seed=3)
    batch, _ = build_batch(
        data, BatchConfig(seq_len=24, num_rows=2, max_sequences=4, max_sequence_len=12)
    )
    # Supervised-like signal: advantage 1 on every completion token of fixed targets.
    batch = batch.replace(advantages=batch.loss_mask.copy())
    return trainer, graphdef, params, batch


def _target_logprob(graphdef, params, batch):
    logits = decoder.jit_forward(graphdef, params, batch.tokens, batch.positions, batch.segment_ids)
    lp = jax.nn.log_softmax(logits, axis=-1)
    lp = np.take_along_axis(np.asarray(lp), batch.targets[..., None], axis=-1)[..., 0]
    return float((lp * batch.loss_mask).sum() / batch.loss_mask.sum())


def test_steps_drive_target_logprobs_up(f32_trainer):
    trainer, graphdef, params, batch = f32_trainer
    before = _target_logprob(graphdef, params, batch)
    state = trainer.init_state(params)
    dev_batch = trainer.put_batch(batch)
    for _ in range(200):
        state, metrics = trainer.train_step(state, dev_batch)
    after = _target_logprob(graphdef, state.params, batch)
    assert before < -3.5 and after > -0.5, (before, after)
    assert int(state.version) == 200 and int(state.skipped) == 0
    assert int(metrics["lag_max"]) >= 198  # tokens were stamped with versions 0..2
    assert float(metrics["clip_fraction"]) > 0.5  # pi/mu far above c = 5 by now
    np.testing.assert_allclose(_target_logprob(graphdef, params, batch), before)  # not donated


def test_non_finite_loss_is_skipped_and_counted(f32_trainer):
    trainer, _, params, batch = f32_trainer
    state = trainer.init_state(params)
    state, _ = trainer.train_step(state, batch)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    bad = batch.replace(advantages=np.where(batch.loss_mask > 0, np.nan, 0.0).astype(np.float32))
    state, metrics = trainer.train_step(state, bad)
    assert int(metrics["skipped"]) == 1 and int(metrics["consecutive_skips"]) == 1
    assert int(state.version) == 1 and int(state.step) == 2
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(a, b)
    tr.check_skips(metrics, trainer.cfg.max_consecutive_skips)  # one in a row: carry on
    state, metrics = trainer.train_step(state, bad)
    with pytest.raises(tr.NonFiniteLossError, match="2 consecutive train steps"):
        trainer.check(metrics)
    state, metrics = trainer.train_step(state, batch)
    assert int(metrics["consecutive_skips"]) == 0 and int(metrics["skipped_total"]) == 2
    assert int(state.version) == 2 and np.isfinite(float(metrics["loss"]))


def test_bf16_params_f32_moments_kl_entropy_micro_batches():
    cfg = tiny_model(param_dtype="bfloat16", compute_dtype="bfloat16")
    graphdef, params = decoder.init(cfg, jax.random.key(4))
    loss = LossConfig(
        objective="ppo",
        kl_coef=0.1,
        entropy_coef=0.02,
        entropy_coef_end=0.0,
        entropy_schedule_steps=2,
    )
    tcfg = tr.TrainerConfig(
        learning_rate=1e-2, warmup_steps=1, total_steps=10, micro_batches=2, loss=loss
    )
    trainer = tr.Trainer(tcfg, graphdef, decoder.abstract_init(cfg)[1], tr.trainer_mesh())
    batch, _ = build_batch(
        samples([(3, 6), (4, 5), (2, 7), (3, 4)]),
        BatchConfig(seq_len=16, num_rows=4, max_sequences=4, max_sequence_len=12),
    )
    state = trainer.init_state(params)
    history = []
    for _ in range(3):
        state, metrics = trainer.train_step(state, batch)
        history.append(jax.device_get(metrics))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
    assert [float(m["entropy_coef"]) for m in history] == pytest.approx([0.02, 0.01, 0.0])
    assert [float(m["lr"]) for m in history][:2] == pytest.approx([0.0, 1e-2])
    assert float(history[0]["kl_ref"]) == pytest.approx(0.0, abs=1e-6)  # ref == params at start
    assert float(history[2]["kl_ref"]) > 0 and int(state.version) == 3
    assert all(np.isfinite(float(m["loss"])) for m in history)
    for a, b in zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # reference stays frozen


def test_tied_bf16_head_trains_like_the_f32_head():
    """A tied LM head (SmolLM2's) with loss.head_dtype="bfloat16" under bf16 compute: XLA:CPU
    once emitted the head's weight-gradient dot in a form its runtime refuses ("Unsupported
    element type for DotThunk::Execute: BF16 x BF16 = F32"; rl/logprobs.py keeps it whole).
    The step runs, and its loss and update are the f32 head's within bf16 rounding."""
    vocab = 8192  # the failure needs a vocabulary this size; smaller ones took another layout
    cfg = tiny_model(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        attention_bias=False,
        tie_word_embeddings=True,
        compute_dtype="bfloat16",
        max_position_embeddings=256,
    )
    graphdef, params = decoder.init(cfg, jax.random.key(3))
    rng = np.random.default_rng(3)
    items = [
        ScoredSample(
            rng.integers(0, vocab, 16).tolist(),
            rng.integers(0, vocab, 112).tolist(),
            (-rng.random(112) * 2 - 8).tolist(),
            [0] * 112,
            float(i % 2),
            i // 2,
        )
        for i in range(2)
    ]
    batch_cfg = BatchConfig(seq_len=128, num_rows=2, max_sequences=2, max_sequence_len=128)
    batch, _ = build_batch(items, batch_cfg)
    out = {}
    for head in ("float32", "bfloat16"):
        tcfg = tr.TrainerConfig(
            learning_rate=1e-3,
            lr_schedule="constant",
            warmup_steps=0,
            loss=LossConfig(head_dtype=head),
        )
        trainer = tr.Trainer(tcfg, graphdef, params, tr.trainer_mesh(jax.devices()[:1]))
        state, metrics = trainer.train_step(trainer.init_state(params), batch)
        out[head] = (float(metrics["loss"]), np.asarray(decoder.arrays(state.params)["embed"]))
    (loss32, embed32), (loss16, embed16) = out["float32"], out["bfloat16"]
    assert np.isfinite(loss16) and abs(loss16 - loss32) <= 2e-2 * abs(loss32)
    before = np.asarray(decoder.arrays(params)["embed"])
    moved32, moved16 = embed32 - before, embed16 - before
    assert np.abs(moved16).max() > 0  # the tied table was updated through the head
    cos = np.sum(moved16 * moved32) / np.linalg.norm(moved16) / np.linalg.norm(moved32)
    assert cos > 0.9


def test_optimizer_pieces():
    cfg = tr.TrainerConfig(learning_rate=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    lr = tr.learning_rate_schedule(cfg)
    assert float(lr(5)) == pytest.approx(0.5) and float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.55) and float(lr(110)) == pytest.approx(0.1)
    const = tr.learning_rate_schedule(dataclasses.replace(cfg, lr_schedule="constant"))
    assert float(const(3)) == pytest.approx(0.3) and float(const(500)) == 1.0
    _, params = decoder.abstract_init(tiny_model())
    mask = {
        jax.tree_util.keystr(p): v
        for p, v in jax.tree_util.tree_leaves_with_path(tr.decay_mask(params))
    }
    assert not any(v for k, v in mask.items() if "norm" in k or "bias" in k)
    assert mask["['layers']['q_proj'].value"] and mask["['lm_head'].value"]
    assert sum(mask.values()) == 9


def test_trainer_bad_config():
    with pytest.raises(ConfigError, match="lr_schedule"):
        tr.TrainerConfig(lr_schedule="linear")
    with pytest.raises(ConfigError, match="tp=3"):
        tr.trainer_mesh(jax.devices(), tp=3)
