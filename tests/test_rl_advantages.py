"""Group advantages and token weights by hand (rl/advantages.py, rl/weights.py)."""

import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rl.advantages import group_advantages, zero_std_groups
from pipelinerl_jax.rl.weights import sequence_token_weights


def test_group_mean_by_hand():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 3.0], [7, 7, 7, 2, 2])
    np.testing.assert_allclose(adv, [2 / 3, -1 / 3, -1 / 3, -1.0, 1.0], rtol=1e-6)


def test_leave_one_out_by_hand():
    adv = group_advantages([1.0, 0.0, 2.0], [0, 0, 0], mode="leave_one_out")
    np.testing.assert_allclose(adv, [1 - 1.0, 0 - 1.5, 2 - 0.5], rtol=1e-6)


def test_std_normalisation_by_hand():
    r = np.array([1.0, 0.0, 0.0, 0.0])
    std = np.sqrt(np.mean((r - 0.25) ** 2))
    adv = group_advantages(r, [3] * 4, normalize_std=True, eps=0.0)
    np.testing.assert_allclose(adv, (r - 0.25) / std, rtol=1e-6)


@pytest.mark.parametrize("mode", ["group_mean", "leave_one_out"])
@pytest.mark.parametrize("normalize_std", [False, True])
def test_group_advantages_have_zero_mean(mode, normalize_std):
    rng = np.random.default_rng(0)
    groups = rng.permutation(np.repeat(np.arange(12), rng.integers(2, 9, 12)))
    rewards = rng.normal(size=groups.size)
    adv = group_advantages(rewards, groups, mode=mode, normalize_std=normalize_std)
    for g in np.unique(groups):
        assert abs(adv[groups == g].astype(np.float64).mean()) < 1e-6


def test_zero_std_groups_flags_all_equal_groups():
    flat = zero_std_groups([1, 1, 0, 1, 0.5, 0.5], [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(flat, [True, True, False, False, True, True])


def test_advantage_bad_inputs():
    with pytest.raises(ConfigError, match="leave_one_out"):
        group_advantages([1.0, 0.0], [0, 1], mode="leave_one_out")
    with pytest.raises(ConfigError, match="NaN"):
        group_advantages([1.0, np.nan], [0, 0])
    with pytest.raises(ConfigError, match="same length"):
        group_advantages([1.0, 0.0], [0])
    with pytest.raises(ConfigError, match="advantage mode"):
        group_advantages([1.0, 0.0], [0, 0], mode="median")


LENGTHS, GROUPS = [2, 3, 1, 4], [0, 0, 1, 1]


def test_weights_by_hand():
    keep = [True] * 4
    np.testing.assert_allclose(
        sequence_token_weights(LENGTHS, GROUPS, keep, "sequence_sum"), [1 / 4] * 4
    )
    np.testing.assert_allclose(
        sequence_token_weights(LENGTHS, GROUPS, keep, "token_mean"), [1 / 10] * 4
    )
    np.testing.assert_allclose(
        sequence_token_weights(LENGTHS, GROUPS, keep, "sequence_mean"),
        [1 / 8, 1 / 12, 1 / 4, 1 / 16],
    )
    np.testing.assert_allclose(
        sequence_token_weights(LENGTHS, GROUPS, keep, "group_token_mean"),
        [1 / 10, 1 / 10, 1 / 10, 1 / 10],
    )
    np.testing.assert_allclose(
        sequence_token_weights([2, 3, 1, 1], GROUPS, keep, "group_token_mean"),
        [1 / 10, 1 / 10, 1 / 4, 1 / 4],
    )


def test_overlong_filter_removes_sequences_from_the_counts():
    keep = [True, False, True, True]
    np.testing.assert_allclose(
        sequence_token_weights(LENGTHS, GROUPS, keep, "sequence_sum"), [1 / 3, 0, 1 / 3, 1 / 3]
    )
    np.testing.assert_allclose(
        sequence_token_weights(LENGTHS, GROUPS, keep, "token_mean"), [1 / 7, 0, 1 / 7, 1 / 7]
    )
    assert not sequence_token_weights(LENGTHS, GROUPS, [False] * 4, "token_mean").any()


def test_weights_bad_mode():
    with pytest.raises(ConfigError, match="weighting"):
        sequence_token_weights(LENGTHS, GROUPS, [True] * 4, "per_prompt")
