"""The training batch: finished samples packed into fixed rows, built on the host with numpy.

Each sample (prompt + completion) is laid out contiguously in one row of T tokens; rows hold
several samples, told apart by segment ids (1, 2, ... within a row; 0 is padding), so attention
never crosses samples. Positions restart at 0 for every sample. Every per-token field is
indexed by the position whose logits are scored: position t holds input tokens[t] and scores
targets[t] (the next token of the same sample), so the loss mask covers the positions from the
last prompt token to the second-to-last completion token.

Episodes (several turns with an environment): the completion holds every model turn and the
environment's observations between them, as sampled. Observation tokens carry version -1; they
are context only: off the loss mask, out of the token counts the weights normalise by, and out
of the lag statistics (which read versions under the mask).

Packing is first-fit in sample order into `num_rows` rows. The row count is fixed by the
config so the train step compiles once; a sample longer than a row is a configuration error
(never a silent truncation). Letters (pipelinerl_jax/__init__.py): R rows, T row length, B sequences
(the capacity, `max_sequences`).

Shared prompts (`BatchConfig.share_prompts`): the attempts of a group share one prompt, so a
row can hold that prompt once and each attempt after it. The prompt minus its last token is a
prefix segment; each attempt is a segment [last prompt token, completion...] whose positions
continue the prefix's, and whose `prefix_ids` name the prefix segment so its queries also see
the prefix's keys. Every attempt's tokens then see exactly what they see in the unshared
layout (same positions, same keys), so logprobs and gradients are the same, and a group of G
attempts trains P - 1 + sum(1 + C_i) tokens instead of sum(P + C_i). A group too long for a
row is split into runs of attempts, each with its own copy of the prefix. Shared layouts are
never longer than unshared ones, so `BatchConfig.rows_for` bounds both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import numpy as np

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rl.advantages import group_advantages, zero_std_groups
from pipelinerl_jax.rl.config import BatchConfig
from pipelinerl_jax.rl.weights import sequence_token_weights


@dataclasses.dataclass(frozen=True)
class ScoredSample:
    """One finished, scored generation: what the batch builder packs. (The sampler's own
    `sampler.protocol.Sample` is the unscored attempt; pipeline/groups.py adds the reward.)"""

    prompt_tokens: Sequence[int]  # [P] prompt token ids
    completion_tokens: Sequence[int]  # [C] generated token ids (EOS included if emitted)
    completion_logprobs: Sequence[float]  # [C] behaviour logprob mu of each generated token
    completion_versions: Sequence[int]  # [C] policy version that generated each token; -1:
    #   an observation token of an episode (the environment's, not trained on)
    reward: float
    group_id: int  # samples of the same prompt share a group id
    finished: bool = True  # False: stopped at max_new_tokens without EOS


@flax.struct.dataclass
class TrainBatch:
    """One optimizer step's data. Token fields [R, T]; sequence fields [B] (padded, masked)."""

    tokens: jax.Array  # [R, T] int32 input ids (0 in padding)
    positions: jax.Array  # [R, T] int32 position within the sample
    segment_ids: jax.Array  # [R, T] int32 segment number within its row, 1..; 0 = padding
    prefix_ids: jax.Array  # [R, T] int32 the shared-prompt segment this token's sample
    #   continues (its keys are visible too); -1 for none
    targets: jax.Array  # [R, T] int32 the next token, whose logprob is scored
    loss_mask: jax.Array  # [R, T] f32 1 where targets is a completion token
    behaviour_logprobs: jax.Array  # [R, T] f32 sampler logprob mu of targets (0 off the mask)
    versions: jax.Array  # [R, T] int32 policy version that sampled targets (0 off mask)
    advantages: jax.Array  # [R, T] f32 the sample's advantage on its completion tokens
    token_weights: jax.Array  # [R, T] f32 aggregation weight: loss = sum w * loss_t
    sequence_index: jax.Array  # [R, T] int32 index into the B axis; B for padding/prompts
    rewards: jax.Array  # [B] f32
    sequence_advantages: jax.Array  # [B] f32
    group_ids: jax.Array  # [B] int32 (-1 for padding)
    completion_lengths: jax.Array  # [B] int32
    sequence_mask: jax.Array  # [B] f32 1 for real samples

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    @property
    def num_sequences(self) -> int:
        return int(self.rewards.shape[0])


TOKEN_FIELDS = (
    "tokens",
    "positions",
    "segment_ids",
    "prefix_ids",
    "targets",
    "loss_mask",
    "behaviour_logprobs",
    "versions",
    "advantages",
    "token_weights",
    "sequence_index",
)
SEQUENCE_FIELDS = (
    "rewards",
    "sequence_advantages",
    "group_ids",
    "completion_lengths",
    "sequence_mask",
)


def pack_first_fit(lengths: Sequence[int], seq_len: int, num_rows: int) -> list[tuple[int, int]]:
    """(row, offset) of each sequence: first row with room, in input order.

    Raises ConfigError for a sequence longer than a row, or when `num_rows` rows do not suffice
    (BatchConfig.rows_for gives a row count that first-fit can never overflow).
    """
    free = []  # free tokens per opened row
    placement = []
    for i, length in enumerate(lengths):
        if length > seq_len:
            raise ConfigError(
                f"sample {i} has {length} tokens, more than a packed row "
                f"(batch.seq_len={seq_len}); raise batch.seq_len"
            )
        for row, room in enumerate(free):  # noqa: B007 (row is used after the loop)
            if room >= length:
                break
        else:
            row = len(free)
            if row == num_rows:
                raise ConfigError(
                    f"{len(lengths)} samples ({sum(lengths)} tokens) do not fit in batch.num_rows="
                    f"{num_rows} rows of {seq_len}; set batch.num_rows to "
                    f"{BatchConfig.rows_for(len(lengths), max(lengths), seq_len)} (BatchConfig.rows_for)"
                )
            free.append(seq_len)
        placement.append((row, seq_len - free[row]))
        free[row] -= length
    return placement


@dataclasses.dataclass
class _Piece:
    """Samples laid out contiguously in one row: a shared prefix, then each member's segment."""

    prefix_len: int  # prompt tokens laid out once for all members (0: none)
    members: list[int]  # indices into the kept samples
    length: int  # prefix + every member's remaining prompt and completion


def _pieces(samples: Sequence[ScoredSample], seq_len: int, share: bool) -> list[_Piece]:
    """Each sample alone, or (share) runs of consecutive samples of one group with one prompt,
    cut so that each run fits a row: prefix (prompt minus its last token) + sum(1 + C_i)."""
    pieces: list[_Piece] = []
    for k, s in enumerate(samples):
        total = len(s.prompt_tokens) + len(s.completion_tokens)
        last = pieces[-1] if pieces else None
        if (
            share
            and last is not None
            and last.prefix_len
            and samples[last.members[0]].group_id == s.group_id
            and len(s.prompt_tokens) == last.prefix_len + 1
            and list(samples[last.members[0]].prompt_tokens) == list(s.prompt_tokens)
            and last.length + total - last.prefix_len <= seq_len
        ):
            last.members.append(k)
            last.length += total - last.prefix_len
            continue
        prefix = len(s.prompt_tokens) - 1 if share else 0
        pieces.append(_Piece(prefix, [k], total))
    return pieces


def build_batch(samples: Sequence[ScoredSample], cfg: BatchConfig) -> tuple[TrainBatch, dict]:
    """Advantages, filtering, token weights and packing. Returns (numpy TrainBatch, host stats)."""
    if len(samples) > cfg.max_sequences:
        raise ConfigError(f"{len(samples)} samples exceed batch.max_sequences={cfg.max_sequences}")
    for i, s in enumerate(samples):
        c = len(s.completion_tokens)
        if not len(s.completion_logprobs) == len(s.completion_versions) == c:
            raise ConfigError(
                f"sample {i}: completion_tokens ({c}), completion_logprobs "
                f"({len(s.completion_logprobs)}) and completion_versions "
                f"({len(s.completion_versions)}) must have equal lengths"
            )
        if c == 0 or len(s.prompt_tokens) == 0:
            raise ConfigError(f"sample {i}: empty prompt or completion; every sample needs both")
        if min(s.completion_versions) < -1 or max(s.completion_versions) < 0:
            raise ConfigError(
                f"sample {i}: completion versions must be >= 0 (model tokens) or -1 "
                "(observations), with at least one model token"
            )
        if len(s.prompt_tokens) + c > cfg.max_sequence_len:
            raise ConfigError(
                f"sample {i} has {len(s.prompt_tokens) + c} tokens, more than batch.max_sequence_len="
                f"{cfg.max_sequence_len}; the sampler's limits and the batch config disagree"
            )
    rewards = np.array([s.reward for s in samples], np.float64)
    groups = np.array([s.group_id for s in samples], np.int64)
    adv_N = group_advantages(rewards, groups, mode=cfg.advantage, normalize_std=cfg.normalize_std)
    keep = np.ones(len(samples), bool)
    flat = zero_std_groups(rewards, groups) if samples else keep
    if cfg.filter_zero_std_groups:
        keep &= ~flat
    kept = [i for i in range(len(samples)) if keep[i]]
    finished = np.array([samples[i].finished for i in kept], bool)
    model_tokens = [np.asarray(s.completion_versions) >= 0 for s in samples]  # [C] each
    lengths = np.array([model_tokens[i].sum() for i in kept], np.int64)
    weight_N = sequence_token_weights(
        lengths,
        groups[kept],
        finished if cfg.overlong_filter else np.ones_like(finished),
        cfg.weighting,
    )

    R, T, B = cfg.num_rows, cfg.seq_len, cfg.max_sequences
    out = {
        name: np.zeros((R, T), np.int32)
        for name in ("tokens", "positions", "segment_ids", "targets", "versions")
    }
    out["prefix_ids"] = np.full((R, T), -1, np.int32)
    for name in ("loss_mask", "behaviour_logprobs", "advantages", "token_weights"):
        out[name] = np.zeros((R, T), np.float32)
    out["sequence_index"] = np.full((R, T), B, np.int32)
    seq = dict(
        rewards=np.zeros(B, np.float32),
        sequence_advantages=np.zeros(B, np.float32),
        group_ids=np.full(B, -1, np.int32),
        completion_lengths=np.zeros(B, np.int32),
        sequence_mask=np.zeros(B, np.float32),
    )
    pieces = _pieces([samples[i] for i in kept], T, cfg.share_prompts)
    placement = pack_first_fit([piece.length for piece in pieces], T, R)
    segments_in_row = np.zeros(R, np.int32)
    for piece, (row, off) in zip(pieces, placement):
        prefix_id = -1
        if piece.prefix_len:
            segments_in_row[row] += 1
            prefix_id = segments_in_row[row]
            first = samples[kept[piece.members[0]]].prompt_tokens
            sl = slice(off, off + piece.prefix_len)
            out["tokens"][row, sl] = first[: piece.prefix_len]
            out["positions"][row, sl] = np.arange(piece.prefix_len)
            out["segment_ids"][row, sl] = prefix_id
            out["targets"][row, sl] = first[1 : piece.prefix_len + 1]
            off += piece.prefix_len
        for k in piece.members:
            i = kept[k]
            s = samples[i]
            ids = np.concatenate(
                [np.asarray(s.prompt_tokens[piece.prefix_len :]), np.asarray(s.completion_tokens)]
            )
            p, c = len(s.prompt_tokens) - piece.prefix_len, len(s.completion_tokens)
            sl = slice(off, off + p + c)
            segments_in_row[row] += 1
            out["tokens"][row, sl] = ids
            out["positions"][row, sl] = piece.prefix_len + np.arange(p + c)
            out["segment_ids"][row, sl] = segments_in_row[row]
            out["prefix_ids"][row, sl] = prefix_id
            out["targets"][row, off : off + p + c - 1] = ids[1:]
            scored = slice(
                off + p - 1, off + p + c - 1
            )  # positions whose target is a completion token
            model_C = model_tokens[i]
            out["loss_mask"][row, scored] = model_C
            out["behaviour_logprobs"][row, scored] = np.where(
                model_C, np.asarray(s.completion_logprobs, np.float32), 0.0
            )
            out["versions"][row, scored] = np.where(
                model_C, np.asarray(s.completion_versions, np.int32), 0
            )
            out["advantages"][row, scored] = adv_N[i] * model_C
            out["token_weights"][row, scored] = weight_N[k] * model_C
            out["sequence_index"][row, scored] = np.where(model_C, k, B)
            seq["rewards"][k], seq["sequence_advantages"][k] = s.reward, adv_N[i]
            seq["group_ids"][k], seq["completion_lengths"][k] = s.group_id, model_C.sum()
            seq["sequence_mask"][k] = 1.0
            off += p + c
    if not np.all(np.isfinite(out["behaviour_logprobs"])):
        raise ConfigError(
            "build_batch: behaviour logprobs contain NaN/Inf; the sampler must record "
            "finite logprobs (check the sampling temperature)"
        )
    laid_out = sum(piece.length for piece in pieces)
    rows_used = int(max((r for r, _ in placement), default=-1) + 1)
    unshared = sum(len(samples[i].prompt_tokens) + len(samples[i].completion_tokens) for i in kept)
    stats = {
        "samples": len(samples),
        "groups": int(np.unique(groups).size),
        "zero_std_groups": int(np.unique(groups[flat]).size) if samples else 0,
        "filtered_samples": int((~keep).sum()),
        "overlong_samples": int((~finished).sum()),
        "trained_samples": len(kept),
        "completion_tokens": int(lengths.sum()),  # model tokens (observations are not)
        "observation_tokens": int(sum((~model_tokens[i]).sum() for i in kept)),
        "rows_used": rows_used,
        "packed_tokens": laid_out,
        "unshared_tokens": unshared,
        "padding_fraction": 1.0 - float(laid_out) / (R * T),
        # What a step computes when empty one-row micro-batches are skipped (trainer.py).
        "used_rows_padding_fraction": 1.0 - float(laid_out) / max(1, rows_used * T),
    }
    return TrainBatch(**out, **seq), stats
