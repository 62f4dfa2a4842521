"""Group-relative advantages, computed on the host from the rewards of one step's samples.

A group is the G attempts at one prompt. The baseline is the group's mean reward (the paper's
runs) or the leave-one-out mean of the other attempts; optionally the result is divided by the
group's reward standard deviation. Groups whose rewards are all equal carry no learning signal
under either baseline, and can be filtered out (and counted) before packing.
Letters (pipelinerl_jax/__init__.py): B samples, U groups.
"""

from __future__ import annotations

import numpy as np

from pipelinerl_jax.errors import ConfigError


def _group_index(group_ids_B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dense group index per sample, group sizes) for arbitrary integer group ids."""
    _, index_B, sizes_U = np.unique(group_ids_B, return_inverse=True, return_counts=True)
    return index_B.reshape(-1), sizes_U


def group_advantages(
    rewards_B,
    group_ids_B,
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
    rewards_B = np.asarray(rewards_B, np.float64).reshape(-1)
    group_ids_B = np.asarray(group_ids_B).reshape(-1)
    if rewards_B.shape != group_ids_B.shape:
        raise ConfigError(
            f"group_advantages: rewards {rewards_B.shape} and group_ids "
            f"{group_ids_B.shape} must have the same length"
        )
    if not np.all(np.isfinite(rewards_B)):
        raise ConfigError(
            "group_advantages: rewards contain NaN/Inf; reward functions must return finite numbers"
        )
    if rewards_B.size == 0:
        return np.zeros(0, np.float32)
    index_B, sizes_U = _group_index(group_ids_B)
    mean_U = np.bincount(index_B, weights=rewards_B) / sizes_U
    centred_B = rewards_B - mean_U[index_B]
    if mode == "group_mean":
        adv_B = centred_B
    elif mode == "leave_one_out":
        if np.any(sizes_U < 2):
            raise ConfigError(
                "advantage='leave_one_out' needs at least 2 samples per group; "
                "use group_size >= 2 or advantage='group_mean'"
            )
        size_B = sizes_U[index_B]
        adv_B = centred_B * size_B / (size_B - 1)
    else:
        raise ConfigError(f"advantage mode {mode!r}; use 'group_mean' or 'leave_one_out'")
    if normalize_std:
        std_U = np.sqrt(np.bincount(index_B, weights=centred_B**2) / sizes_U)
        adv_B = adv_B / (std_U[index_B] + eps)
    return adv_B.astype(np.float32)


def zero_std_groups(rewards_B, group_ids_B) -> np.ndarray:
    """bool [N]: the sample's group has all-equal rewards (zero advantage for every member)."""
    rewards_B = np.asarray(rewards_B, np.float64).reshape(-1)
    index_B, _ = _group_index(np.asarray(group_ids_B).reshape(-1))
    num_groups = int(index_B.max()) + 1 if index_B.size else 0
    lo_U = np.full(num_groups, np.inf)
    hi_U = np.full(num_groups, -np.inf)
    np.minimum.at(lo_U, index_B, rewards_B)
    np.maximum.at(hi_U, index_B, rewards_B)
    return (hi_U - lo_U)[index_B] == 0
