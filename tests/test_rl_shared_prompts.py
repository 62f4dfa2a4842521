"""Shared-prompt packing (BatchConfig.share_prompts): the layout by hand, the same logprobs,
loss and gradients as one prompt copy per attempt, and empty micro-batches skipped exactly."""

import jax
import numpy as np
import pytest

from pipelinerl_jax.models import decoder
from pipelinerl_jax.rl.batch import ScoredSample, build_batch
from pipelinerl_jax.rl.config import BatchConfig
from pipelinerl_jax.train import trainer as tr
from tests.test_trainer import VOCAB, tiny_model, two_losses_and_grads


def _group_samples(prompt_lengths, completion_lengths, seed):
    """Groups of attempts: group g has one random prompt of prompt_lengths[g] tokens and one
    attempt per entry of completion_lengths[g]; logprobs, versions and rewards are random."""
    rng = np.random.default_rng(seed)
    out = []
    for g, (p, cs) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt = rng.integers(0, VOCAB, p).tolist()
        for c in cs:
            out.append(
                ScoredSample(
                    prompt,
                    rng.integers(0, VOCAB, c).tolist(),
                    (-rng.random(c) * 2 - 3).tolist(),
                    rng.integers(0, 3, c).tolist(),
                    float(rng.random()),
                    g,
                    bool(rng.random() < 0.8),
                )
            )
    return out


def test_shared_layout_by_hand():
    samples = [
        ScoredSample([11, 12, 13], [14, 15], [-0.1, -0.2], [3, 4], 1.0, 0),
        ScoredSample([11, 12, 13], [16], [-0.3], [3], 0.0, 0),
        ScoredSample([21], [22, 23], [-0.4, -0.5], [5, 5], 0.5, 1),
    ]
    cfg = BatchConfig(
        seq_len=12, num_rows=2, max_sequences=3, max_sequence_len=5, share_prompts=True
    )
    batch, stats = build_batch(samples, cfg)
    # Row 0: prefix [11, 12] (segment 1), then [13, 14, 15] and [13, 16] (segments 2 and 3,
    # both continuing segment 1), then the one-token prompt of group 1 alone (segment 4).
    np.testing.assert_array_equal(batch.tokens[0], [11, 12, 13, 14, 15, 13, 16, 21, 22, 23, 0, 0])
    np.testing.assert_array_equal(batch.positions[0], [0, 1, 2, 3, 4, 2, 3, 0, 1, 2, 0, 0])
    np.testing.assert_array_equal(batch.segment_ids[0], [1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 0, 0])
    np.testing.assert_array_equal(batch.prefix_ids[0], [-1, -1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(batch.targets[0], [12, 13, 14, 15, 0, 16, 0, 22, 23, 0, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 0])
    np.testing.assert_allclose(
        batch.behaviour_logprobs[0], [0, 0, -0.1, -0.2, 0, -0.3, 0, -0.4, -0.5, 0, 0, 0], rtol=1e-6
    )
    np.testing.assert_array_equal(batch.sequence_index[0], [3, 3, 0, 0, 3, 1, 3, 2, 2, 3, 3, 3])
    assert not batch.loss_mask[1].any()
    assert stats["packed_tokens"] == 10 and stats["unshared_tokens"] == 12
    assert stats["rows_used"] == 1
    assert stats["padding_fraction"] == pytest.approx(1 - 10 / 24)
    assert stats["used_rows_padding_fraction"] == pytest.approx(1 - 10 / 12)


def _logprobs_by_sequence(graphdef, params, batch):
    """Per sample, its completion's target logprobs in order, read off the packed batch."""
    logits = decoder.jit_forward(
        graphdef, params, batch.tokens, batch.positions, batch.segment_ids, batch.prefix_ids
    )
    lp = np.take_along_axis(
        np.asarray(jax.nn.log_softmax(logits, -1)), np.asarray(batch.targets)[..., None], -1
    )[..., 0]
    out = {}
    for r, t in zip(*np.nonzero(batch.loss_mask)):
        out.setdefault(int(batch.sequence_index[r, t]), []).append(lp[r, t])
    return out


@pytest.mark.parametrize("seq_len", [24, 40])
def test_shared_prompts_same_logprobs_loss_and_grads(seq_len):
    cfg = tiny_model()
    graphdef, params = decoder.init(cfg, jax.random.key(4))
    data = _group_samples([6, 9, 1], [[5, 2, 7], [3, 6], [4, 6]], seed=5)
    plain = BatchConfig(seq_len=16, num_rows=7, max_sequences=7, max_sequence_len=16)
    shared = BatchConfig(
        seq_len=seq_len, num_rows=7, max_sequences=7, max_sequence_len=16, share_prompts=True
    )
    b_plain, s_plain = build_batch(data, plain)
    b_shared, s_shared = build_batch(data, shared)
    assert s_shared["packed_tokens"] < s_plain["packed_tokens"] == s_shared["unshared_tokens"]
    # Tokens of attempts that continue a prefix: group 0 (22 laid out, 5 prefix), group 1 (19, 8).
    assert (b_shared.prefix_ids >= 0).sum() == (22 - 5) + (19 - 8)

    lp_plain = _logprobs_by_sequence(graphdef, params, b_plain)
    lp_shared = _logprobs_by_sequence(graphdef, params, b_shared)
    assert sorted(lp_plain) == sorted(lp_shared) == list(range(7))
    for k in lp_plain:
        np.testing.assert_allclose(lp_shared[k], lp_plain[k], rtol=1e-5, atol=1e-5)

    ((l1, s1), g1), ((l2, s2), g2) = two_losses_and_grads(graphdef, params, b_plain, 0, b_shared, 7)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    assert float(s1["tokens"]) == float(s2["tokens"]) == sum(len(s.completion_tokens) for s in data)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        scale = float(np.abs(a).max())
        np.testing.assert_allclose(b, a, atol=1e-5 * scale)


def test_long_groups_are_cut_into_runs_with_their_own_prefix():
    data = _group_samples([6], [[5, 5, 5, 5]], seed=6)  # 5 + 4 x 6 = 29 tokens shared
    cfg = BatchConfig(
        seq_len=17, num_rows=4, max_sequences=4, max_sequence_len=11, share_prompts=True
    )
    batch, stats = build_batch(data, cfg)
    # 5 prefix + 2 x 6 = 17 per row: two rows, each starting with the prompt's first 5 tokens.
    assert stats["rows_used"] == 2 and stats["packed_tokens"] == 34
    np.testing.assert_array_equal(batch.tokens[0, :5], data[0].prompt_tokens[:5])
    np.testing.assert_array_equal(batch.tokens[1, :5], data[0].prompt_tokens[:5])
    np.testing.assert_array_equal(batch.prefix_ids[:2, 5:].max(axis=1), [1, 1])


def test_empty_micro_batches_are_skipped_exactly():
    """A step over 6 one-row micro-batches, 4 of them empty, equals one unsplit step."""
    cfg = tiny_model()
    graphdef, params = decoder.init(cfg, jax.random.key(7))
    abstract = decoder.abstract_init(cfg)[1]
    data = _group_samples([6, 9], [[5, 2, 7], [3, 8]], seed=8)
    batch, stats = build_batch(
        data,
        BatchConfig(
            seq_len=40, num_rows=6, max_sequences=5, max_sequence_len=17, share_prompts=True
        ),
    )
    assert stats["rows_used"] == 2  # rows 2-5 hold nothing to score
    results = []
    for micro in (1, 6):
        tcfg = tr.TrainerConfig(
            learning_rate=1e-3,
            lr_schedule="constant",
            warmup_steps=0,
            grad_clip_norm=0.0,
            weight_decay=0.0,
            micro_batches=micro,
        )
        trainer = tr.Trainer(tcfg, graphdef, abstract, tr.trainer_mesh())
        state, metrics = trainer.train_step(trainer.init_state(params), batch)
        results.append((jax.tree.map(np.asarray, state.params), jax.device_get(metrics)))
    (p1, m1), (p6, m6) = results
    for key in ("loss", "grad_norm", "tokens", "entropy", "ess"):
        np.testing.assert_allclose(m6[key], m1[key], rtol=1e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p6)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
