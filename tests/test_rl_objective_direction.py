"""One train step of every objective moves logprobs the way the advantages say.

For each objective in rl/objectives.py OBJECTIVES (tis_reinforce, ppo, gspo), a tiny random model
takes ONE Trainer step on a batch of fresh random completions: in each group one completion has
reward 1 (advantage +0.5) and one reward 0 (advantage -0.5). The behaviour logprobs are the
model's own, so every ratio starts at exactly 1 and no clip is active. With a small learning
rate the step is in the linear regime, so each positive-advantage completion's total logprob
must rise and each negative one's must fall. A sign error in an objective's gradient (or an
objective that ignores the advantage) fails this for that objective.
"""

import jax
import numpy as np
import pytest

from pipelinerl_jax.models import decoder
from pipelinerl_jax.rl.batch import ScoredSample, build_batch
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.rl.objectives import OBJECTIVES
from pipelinerl_jax.train import trainer as tr
from tests.test_trainer import VOCAB, tiny_model

GROUPS = 4
BATCH_CFG = BatchConfig(
    seq_len=16, num_rows=2 * GROUPS, max_sequences=2 * GROUPS, max_sequence_len=16
)


def sequence_logprobs(graphdef, params, batch):
    """Sum of target logprobs per sequence index [S] (the quantity the advantage scales)."""
    logits = decoder.jit_forward(graphdef, params, batch.tokens, batch.positions, batch.segment_ids)
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    lp = np.take_along_axis(lp, np.asarray(batch.targets)[..., None], axis=-1)[..., 0]
    out = np.zeros(BATCH_CFG.max_sequences + 1)
    np.add.at(out, np.asarray(batch.sequence_index), lp * np.asarray(batch.loss_mask))
    return out[:-1]


@pytest.fixture(scope="module")
def model_and_batch():
    cfg = tiny_model(num_layers=1)  # one layer: the check is about the loss, not depth
    graphdef, params = decoder.init(cfg, jax.random.key(7))
    rng = np.random.default_rng(11)
    data = []
    for g in range(GROUPS):
        for reward in (1.0, 0.0):
            prompt = rng.integers(0, VOCAB, 3).tolist()
            completion = rng.integers(0, VOCAB, 6).tolist()
            data.append(ScoredSample(prompt, completion, [0.0] * 6, [0] * 6, reward, g))
    batch, _ = build_batch(data, BATCH_CFG)
    # On-policy: mu = pi, so every importance ratio is 1 and nothing is clipped.
    logits = decoder.jit_forward(graphdef, params, batch.tokens, batch.positions, batch.segment_ids)
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    lp = np.take_along_axis(lp, batch.targets[..., None], axis=-1)[..., 0]
    batch = batch.replace(behaviour_logprobs=(lp * batch.loss_mask).astype(np.float32))
    return cfg, graphdef, params, batch


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_one_step_raises_positive_and_lowers_negative_advantage_logprobs(
    model_and_batch, objective
):
    cfg, graphdef, params, batch = model_and_batch
    adv = np.asarray(batch.sequence_advantages)[: 2 * GROUPS]
    assert (adv[0::2] == 0.5).all() and (adv[1::2] == -0.5).all()  # reward 1 first in each group
    tcfg = tr.TrainerConfig(
        learning_rate=1e-3,
        lr_schedule="constant",
        warmup_steps=0,
        grad_clip_norm=0.0,
        weight_decay=0.0,
        attention_block=0,
        loss=LossConfig(objective=objective),
    )
    trainer = tr.Trainer(tcfg, graphdef, decoder.abstract_init(cfg)[1], tr.trainer_mesh())
    before = sequence_logprobs(graphdef, params, batch)[: 2 * GROUPS]
    state, metrics = trainer.train_step(trainer.init_state(params), batch)
    assert int(metrics["skipped"]) == 0
    after = sequence_logprobs(graphdef, state.params, batch)[: 2 * GROUPS]
    delta = after - before
    assert (delta[0::2] > 0).all(), (objective, delta)  # advantage +0.5: more likely
    assert (delta[1::2] < 0).all(), (objective, delta)  # advantage -0.5: less likely
