"""Group-relative advantages, computed on the host from the rewards of one step's samples.

A group is the G attempts at one prompt. The baseline is the group's mean reward (the paper's
runs) or the leave-one-out mean of the other attempts; optionally the result is divided by the
group's reward standard deviation. Groups whose rewards are all equal carry no learning signal
under either baseline, and can be filtered out (and counted) before packing.
Letters: N samples.
"""

from __future__ import annotations

import numpy as np

from pipelinerl_jax.errors import ConfigError


def _group_index(group_ids_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dense group index per sample, group sizes) for arbitrary integer group ids."""
    _, index_N, sizes_G = np.unique(group_ids_N, return_inverse=True, return_counts=True)
    return index_N.reshape(-1), sizes_G


def group_advantages(
    rewards_N,
    group_ids_N,
    *,
    mode: str = "group_mean",
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> np.ndarray:
    """Per-sample advantages (float32 [N]) relative to each sample's group.

    group_mean:    A_i = r_i - mean(r_group)
    leave_one_out: A_i = r_i - mean(r_j, j != i) = G/(G-1) * (r_i - mean(r_group))
    normalize_std divides by (std(r_group) + eps), std with ddof=0. Either way advantages sum to
    zero within every group.
    """
    rewards_N = np.asarray(rewards_N, np.float64).reshape(-1)
    group_ids_N = np.asarray(group_ids_N).reshape(-1)
    if rewards_N.shape != group_ids_N.shape:
        raise ConfigError(
            f"group_advantages: rewards {rewards_N.shape} and group_ids "
            f"{group_ids_N.shape} must have the same length"
        )
    if not np.all(np.isfinite(rewards_N)):
        raise ConfigError(
            "group_advantages: rewards contain NaN/Inf; reward functions must return finite numbers"
        )
    if rewards_N.size == 0:
        return np.zeros(0, np.float32)
    index_N, sizes_G = _group_index(group_ids_N)
    mean_G = np.bincount(index_N, weights=rewards_N) / sizes_G
    centred_N = rewards_N - mean_G[index_N]
    if mode == "group_mean":
        adv_N = centred_N
    elif mode == "leave_one_out":
        if np.any(sizes_G < 2):
            raise ConfigError(
                "advantage='leave_one_out' needs at least 2 samples per group; "
                "use group_size >= 2 or advantage='group_mean'"
            )
        size_N = sizes_G[index_N]
        adv_N = centred_N * size_N / (size_N - 1)
    else:
        raise ConfigError(f"advantage mode {mode!r}; use 'group_mean' or 'leave_one_out'")
    if normalize_std:
        std_G = np.sqrt(np.bincount(index_N, weights=centred_N**2) / sizes_G)
        adv_N = adv_N / (std_G[index_N] + eps)
    return adv_N.astype(np.float32)


def zero_std_groups(rewards_N, group_ids_N) -> np.ndarray:
    """bool [N]: the sample's group has all-equal rewards (zero advantage for every member)."""
    rewards_N = np.asarray(rewards_N, np.float64).reshape(-1)
    index_N, _ = _group_index(np.asarray(group_ids_N).reshape(-1))
    num_groups = int(index_N.max()) + 1 if index_N.size else 0
    lo_G = np.full(num_groups, np.inf)
    hi_G = np.full(num_groups, -np.inf)
    np.minimum.at(lo_G, index_N, rewards_N)
    np.maximum.at(hi_G, index_N, rewards_N)
    return (hi_G - lo_G)[index_N] == 0
