"""Token weights: how one step's per-token losses are aggregated into its scalar loss.

The step's loss is sum_t w_t * loss_t over all completion tokens of the step, so the
aggregation is fixed on the host once per step and stays exact under packing, micro-batching
and data parallelism (every shard just sums). Every token of a sequence gets the same weight:

  sequence_sum      w = 1 / N_seq                       sum over a sequence's tokens, mean over
                                                        sequences (the paper; no length norm.)
  token_mean        w = 1 / N_tok                       mean over all tokens of the step
  group_token_mean  w = 1 / (N_groups * N_tok(group))   token mean within a group, mean over groups
  sequence_mean     w = 1 / (N_seq * len_i)             token mean within a sequence, mean over
                                                        sequences (GRPO/GSPO style)

Overlong filtering gives weight 0 to samples that ended without EOS; they then also leave the
counts above (they are treated as absent from the step, not as zero-loss members).
Letters (pipelinerl_jax/__init__.py): B sequences.
"""

from __future__ import annotations

import numpy as np

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rl.config import WEIGHTINGS


def sequence_token_weights(completion_lengths_B, group_ids_B, keep_B, mode: str) -> np.ndarray:
    """float32 [N]: the weight of each token of sequence i (0 where keep_B is False)."""
    lengths_B = np.asarray(completion_lengths_B, np.float64).reshape(-1)
    group_ids_B = np.asarray(group_ids_B).reshape(-1)
    keep_B = np.asarray(keep_B, bool).reshape(-1)
    if not lengths_B.shape == group_ids_B.shape == keep_B.shape:
        raise ConfigError(
            f"sequence_token_weights: lengths {lengths_B.shape}, group_ids "
            f"{group_ids_B.shape} and keep {keep_B.shape} must have equal lengths"
        )
    weights_B = np.zeros_like(lengths_B)
    kept_lengths = lengths_B[keep_B]
    num_seq, num_tok = int(keep_B.sum()), float(kept_lengths.sum())
    if num_seq == 0 or num_tok == 0:
        return weights_B.astype(np.float32)
    if mode == "sequence_sum":
        weights_B[keep_B] = 1.0 / num_seq
    elif mode == "token_mean":
        weights_B[keep_B] = 1.0 / num_tok
    elif mode == "sequence_mean":
        weights_B[keep_B] = 1.0 / (num_seq * np.maximum(kept_lengths, 1.0))
    elif mode == "group_token_mean":
        groups, index = np.unique(group_ids_B[keep_B], return_inverse=True)
        group_tokens = np.bincount(index.reshape(-1), weights=kept_lengths)
        weights_B[keep_B] = 1.0 / (len(groups) * np.maximum(group_tokens[index.reshape(-1)], 1.0))
    else:
        raise ConfigError(f"weighting={mode!r}; use one of {WEIGHTINGS}")
    return weights_B.astype(np.float32)
