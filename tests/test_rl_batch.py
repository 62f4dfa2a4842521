"""First-fit packing and the host-side TrainBatch layout (rl/batch.py, rl/config.py)."""

import dataclasses

import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rl.batch import ScoredSample, build_batch, pack_first_fit
from pipelinerl_jax.rl.config import BatchConfig, LossConfig


def test_first_fit_by_hand():
    assert pack_first_fit([5, 3, 4, 2, 6], 8, 3) == [(0, 0), (0, 5), (1, 0), (1, 4), (2, 0)]


def test_rows_for_is_never_exceeded():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, longest, seq_len = rng.integers(1, 40), rng.integers(1, 64), 64
        lengths = rng.integers(1, longest + 1, n).tolist()
        rows = BatchConfig.rows_for(n, longest, seq_len)
        placement = pack_first_fit(lengths, seq_len, rows)
        used = np.zeros(rows, int)
        for (row, off), length in zip(placement, lengths):
            assert off == used[row]
            used[row] += length
        assert used.max() <= seq_len


def test_packing_errors():
    with pytest.raises(ConfigError, match="raise batch.seq_len"):
        pack_first_fit([3, 9], 8, 4)
    with pytest.raises(ConfigError, match="rows_for"):
        pack_first_fit([5, 5, 5], 8, 2)
    with pytest.raises(ConfigError, match="max_sequence_len=20"):
        BatchConfig(seq_len=16, num_rows=2, max_sequences=4, max_sequence_len=20)
    with pytest.raises(ConfigError, match="weighting"):
        BatchConfig(seq_len=16, num_rows=2, max_sequences=4, max_sequence_len=8, weighting="x")
    with pytest.raises(ConfigError, match="objective"):
        LossConfig(objective="dpo")
    with pytest.raises(ConfigError, match="ppo_eps_low"):
        LossConfig(ppo_eps_low=1.5)
    with pytest.raises(ConfigError, match="head_dtype='bf16' must be float32, bfloat16"):
        LossConfig(head_dtype="bf16")


def _sample(prompt, completion, reward, group, finished=True, version=3):
    lp = [-0.1 * (i + 1) for i in range(len(completion))]
    return ScoredSample(
        prompt,
        completion,
        lp,
        [version + i for i in range(len(completion))],
        reward,
        group,
        finished,
    )


def test_build_batch_layout_by_hand():
    samples = [
        _sample([11, 12], [13, 14, 15], 1.0, 0),
        _sample([21], [22, 23], 0.0, 0),
        _sample([31, 32, 33], [34], 0.5, 1, finished=False),
        _sample([41], [42, 43], 0.5, 1),
    ]
    cfg = BatchConfig(seq_len=8, num_rows=2, max_sequences=6, max_sequence_len=5)
    batch, stats = build_batch(samples, cfg)
    # First fit: s0 (5 tokens) -> row 0 [0:5]; s1 (3) -> row 0 [5:8]; s2 (4) -> row 1; s3 -> row 1.
    np.testing.assert_array_equal(
        batch.tokens, [[11, 12, 13, 14, 15, 21, 22, 23], [31, 32, 33, 34, 41, 42, 43, 0]]
    )
    np.testing.assert_array_equal(
        batch.positions, [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 0]]
    )
    np.testing.assert_array_equal(
        batch.segment_ids, [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 2, 2, 2, 0]]
    )
    np.testing.assert_array_equal(
        batch.targets, [[12, 13, 14, 15, 0, 22, 23, 0], [32, 33, 34, 0, 42, 43, 0, 0]]
    )
    np.testing.assert_array_equal(
        batch.loss_mask, [[0, 1, 1, 1, 0, 1, 1, 0], [0, 0, 1, 0, 1, 1, 0, 0]]
    )
    np.testing.assert_allclose(batch.behaviour_logprobs[0], [0, -0.1, -0.2, -0.3, 0, -0.1, -0.2, 0])
    np.testing.assert_array_equal(batch.versions[1], [0, 0, 3, 0, 3, 4, 0, 0])
    np.testing.assert_allclose(batch.advantages[0], [0, 0.5, 0.5, 0.5, 0, -0.5, -0.5, 0])
    np.testing.assert_allclose(batch.token_weights[1], [0, 0, 0.25, 0, 0.25, 0.25, 0, 0])
    np.testing.assert_array_equal(
        batch.sequence_index, [[6, 0, 0, 0, 6, 1, 1, 6], [6, 6, 2, 6, 3, 3, 6, 6]]
    )
    np.testing.assert_allclose(batch.rewards, [1, 0, 0.5, 0.5, 0, 0])
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1, -1, -1])
    np.testing.assert_array_equal(batch.completion_lengths, [3, 2, 1, 2, 0, 0])
    np.testing.assert_array_equal(batch.sequence_mask, [1, 1, 1, 1, 0, 0])
    assert stats["zero_std_groups"] == 1 and stats["overlong_samples"] == 1
    assert stats["rows_used"] == 2 and stats["completion_tokens"] == 8
    assert stats["padding_fraction"] == pytest.approx(1 / 16)


def test_build_batch_filters_and_overlong():
    samples = [
        _sample([11, 12], [13, 14, 15], 1.0, 0),
        _sample([21], [22, 23], 0.0, 0),
        _sample([31, 32, 33], [34], 0.5, 1, finished=False),
        _sample([41], [42, 43], 0.5, 1),
    ]
    cfg = BatchConfig(
        seq_len=8,
        num_rows=2,
        max_sequences=6,
        max_sequence_len=5,
        filter_zero_std_groups=True,
        overlong_filter=True,
        weighting="token_mean",
    )
    batch, stats = build_batch(samples, cfg)
    assert stats["filtered_samples"] == 2 and stats["trained_samples"] == 2
    assert batch.sequence_mask.sum() == 2
    np.testing.assert_allclose(batch.token_weights.sum(), 1.0, rtol=1e-6)  # 5 tokens, 1/5 each
    cfg = BatchConfig(
        seq_len=8, num_rows=2, max_sequences=6, max_sequence_len=5, overlong_filter=True
    )
    batch, _ = build_batch(samples, cfg)
    assert batch.token_weights[1, 2] == 0.0 and batch.loss_mask[1, 2] == 1.0  # s2 has no EOS
    np.testing.assert_allclose(batch.token_weights[0, 1], 1 / 3)


def test_build_batch_bad_samples():
    cfg = BatchConfig(seq_len=8, num_rows=2, max_sequences=2, max_sequence_len=5)
    with pytest.raises(ConfigError, match="equal lengths"):
        build_batch([ScoredSample([1], [2, 3], [-1.0], [0, 0], 1.0, 0)], cfg)
    with pytest.raises(ConfigError, match="max_sequence_len=5"):
        build_batch([_sample([1, 2, 3], [4, 5, 6], 1.0, 0)], cfg)
    with pytest.raises(ConfigError, match="max_sequences=2"):
        build_batch([_sample([1], [2], 1.0, 0)] * 3, cfg)
    with pytest.raises(ConfigError, match="NaN"):
        build_batch([ScoredSample([1], [2, 3], [-1.0, np.nan], [0, 0], 1.0, 0)], cfg)


def test_episode_observations_are_context_only():
    """An episode's completion interleaves model turns and observations (version -1): the
    observation tokens are inputs and targets, but off the loss mask, with no logprob, version,
    advantage or weight, and out of the token counts the weights normalise by."""
    episode = ScoredSample(
        prompt_tokens=[11, 12],
        completion_tokens=[13, 14, 51, 52, 15, 16],  # turn, observation, turn
        completion_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4],
        completion_versions=[2, 2, -1, -1, 3, 3],
        reward=1.0,
        group_id=0,
    )
    single = _sample([21], [22, 23], 0.0, 0)
    cfg = BatchConfig(
        seq_len=12, num_rows=1, max_sequences=2, max_sequence_len=8, weighting="token_mean"
    )
    batch, stats = build_batch([episode, single], cfg)
    np.testing.assert_array_equal(batch.tokens[0, :8], [11, 12, 13, 14, 51, 52, 15, 16])
    np.testing.assert_array_equal(batch.targets[0, :8], [12, 13, 14, 51, 52, 15, 16, 0])
    # Position t scores targets[t]: 13, 14 (model), 51, 52 (observation), 15, 16 (model).
    np.testing.assert_array_equal(batch.loss_mask[0, :8], [0, 1, 1, 0, 0, 1, 1, 0])
    np.testing.assert_allclose(
        batch.behaviour_logprobs[0, :8], [0, -0.1, -0.2, 0, 0, -0.3, -0.4, 0]
    )
    np.testing.assert_array_equal(batch.versions[0, :8], [0, 2, 2, 0, 0, 3, 3, 0])
    np.testing.assert_array_equal(batch.sequence_index[0, :8], [2, 0, 0, 2, 2, 0, 0, 2])
    # token_mean over 4 + 2 model tokens; advantages +-0.5 on model tokens only.
    np.testing.assert_allclose(batch.token_weights[0, :8], np.array([0, 1, 1, 0, 0, 1, 1, 0]) / 6)
    np.testing.assert_allclose(batch.advantages[0, :8], [0, 0.5, 0.5, 0, 0, 0.5, 0.5, 0])
    np.testing.assert_array_equal(batch.completion_lengths, [4, 2])
    assert stats["completion_tokens"] == 6 and stats["observation_tokens"] == 2
    bad = dataclasses.replace(episode, completion_versions=[-1] * 6)
    with pytest.raises(ConfigError, match="at least one model token"):
        build_batch([bad], cfg)
