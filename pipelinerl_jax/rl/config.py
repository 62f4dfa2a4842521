"""Frozen configs for the learning side: how batches are built and which objective is trained.

`BatchConfig` fixes the packed batch shape (rows x row length, sequence capacity) so the train
step compiles once, and chooses advantages and token weights. `LossConfig` picks the objective
and its switches. Both validate themselves at construction: a bad value is a one-line
`ConfigError` naming the field and how to fix it, raised before any sequence is generated.
Defaults are the PipelineRL paper's runs (docs/paper_facts.md). `LossConfig.objective` names an
entry of the objective registry (rl/objectives.py): a built-in or one registered by the user.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models.mixed_matmul import HEAD_DTYPES
from pipelinerl_jax.rl import correction as correction_lib
from pipelinerl_jax.rl import objectives

ADVANTAGES = ("group_mean", "leave_one_out")
# How per-token losses are summed into the step's loss (see rl/weights.py for the formulas).
WEIGHTINGS = ("sequence_sum", "token_mean", "group_token_mean", "sequence_mean")


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"{owner}.{name}={value!r} must be > 0")


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """Packed batch layout and the host-side preprocessing of finished samples."""

    seq_len: int  # T: tokens per packed row
    num_rows: int  # R: rows per optimizer step (fixed so the step compiles once)
    max_sequences: int  # B: sequence capacity of a step (= samples per step)
    max_sequence_len: int  # prompt + completion tokens of the longest possible sample
    advantage: str = "group_mean"  # "group_mean" | "leave_one_out"
    normalize_std: bool = False  # divide advantages by the group's reward std
    filter_zero_std_groups: bool = False  # drop groups whose rewards are all equal (counted)
    # Dynamic sampling (pipeline/filtering.py): drop groups whose raw scores' std is at most
    # filter_min_std and refill the step with newly admitted groups, at most
    # filter_refill_limit x groups_per_step refills per step on average.
    filter_groups: bool = False  # dynamic sampling: drop groups whose raw scores are alike, refill
    filter_min_std: float = 0.0  # drop groups whose raw scores' std is at most this
    filter_refill_limit: float = 4.0  # refills per step, in multiples of groups_per_step
    weighting: str = "sequence_sum"  # "sequence_sum" | "token_mean" | "group_token_mean" |
    #   "sequence_mean" (WEIGHTINGS, rl/weights.py)
    overlong_filter: bool = False  # samples that ended without EOS get weight 0
    # A group's attempts share one copy of their prompt in a row (same logprobs and gradients,
    # fewer tokens: see rl/batch.py). With trainer.micro_batches = num_rows, rows left empty
    # cost nothing, so seq_len can be sized for a typical group rather than the longest.
    share_prompts: bool = False

    def __post_init__(self):
        _positive(
            "batch",
            seq_len=self.seq_len,
            num_rows=self.num_rows,
            max_sequences=self.max_sequences,
            max_sequence_len=self.max_sequence_len,
        )
        if self.max_sequence_len > self.seq_len:
            raise ConfigError(
                f"batch.max_sequence_len={self.max_sequence_len} (prompt + max new tokens) is "
                f"longer than a packed row (batch.seq_len={self.seq_len}); raise batch.seq_len or "
                "shorten prompts/max_new_tokens: sequences are never truncated"
            )
        if self.filter_min_std < 0 or self.filter_refill_limit <= 0:
            raise ConfigError(
                f"batch.filter_min_std={self.filter_min_std} must be >= 0 and "
                f"batch.filter_refill_limit={self.filter_refill_limit} > 0 (refills per step, "
                "in multiples of groups_per_step)"
            )
        if self.advantage not in ADVANTAGES:
            raise ConfigError(f"batch.advantage={self.advantage!r}; use one of {ADVANTAGES}")
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"batch.weighting={self.weighting!r}; use one of {WEIGHTINGS}")

    @staticmethod
    def rows_for(num_sequences: int, max_sequence_len: int, seq_len: int) -> int:
        """Rows that first-fit packing can never overflow for these sequences.

        First-fit leaves no two rows both at most half full (the later row's first sequence would
        have fitted into the earlier one), so R rows hold more than floor(R/2) full rows of tokens;
        hence R <= ceil(2 * total / seq_len) always suffices, and one sequence per row is the cap.
        """
        total = num_sequences * max_sequence_len
        return max(1, min(num_sequences, math.ceil(2 * total / seq_len)))


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The objective and its switches; every coefficient is a plain float (hashable, jit-static)."""

    objective: str = "tis_reinforce"  # "tis_reinforce" | "ppo" | "gspo" | "cispo" | a name
    #   registered with pipelinerl_jax.rl.objectives.register_objective
    tis_clip: float = 5.0  # c in min(pi/mu, c)
    ppo_eps_low: float = 0.2  # ratio clipped to [1 - eps_low, 1 + eps_high]
    ppo_eps_high: float = 0.28  # (the upper clip is wider: DAPO's clip-higher)
    gspo_eps_low: float = 3e-4  # sequence ratios live much closer to 1
    gspo_eps_high: float = 4e-4  # upper clip of the sequence ratio
    # CISPO clips the IS weight to [1 - eps_low, 1 + eps_high]: MiniMax-M1 sets no lower
    # bound (eps_low = 1) and tunes only the upper one; 5 is SkyRL's default for it.
    cispo_eps_low: float = 1.0  # CISPO's weight clipped below at 1 - eps_low (1: no bound)
    cispo_eps_high: float = 5.0  # CISPO's weight clipped above at 1 + eps_high
    # Rollout correction (rl/correction.py): "none" | "token_mask" | "sequence_mask" |
    # "sequence_reject" masks tokens or sequences whose ratio leaves [correction_low,
    # correction_high], on the tokens `correction_applies` names: "both" | "staleness" (lag
    # >= 1) | "mismatch" (lag 0, where the ratio is the sampler/trainer mismatch alone).
    correction: str = "none"  # "none" | "token_mask" | "sequence_mask" | "sequence_reject"
    correction_applies: str = "both"  # "both" | "staleness" (lag >= 1) | "mismatch" (lag 0)
    correction_low: float = 0.5  # a ratio below this is masked (rl/correction.py)
    correction_high: float = 2.0  # a ratio above this is masked
    temperature: float = 1.0  # sampling temperature: logits / temperature before softmax
    kl_coef: float = 0.0  # k3 KL to the reference policy, linear from kl_coef ...
    kl_coef_end: float | None = None  # ... to kl_coef_end over kl_schedule_steps (None: constant)
    kl_schedule_steps: int = 0  # steps of the kl_coef -> kl_coef_end schedule
    entropy_coef: float = 0.0  # entropy bonus, same linear schedule form
    entropy_coef_end: float | None = None  # None: constant entropy_coef
    entropy_schedule_steps: int = 0  # steps of the entropy_coef -> entropy_coef_end schedule
    # The LM head and log-softmax run in f32 over chunks so [tokens, V] f32 never exists whole.
    # Per-token objectives (tis_reinforce, ppo, registered ones) fuse loss and head gradient
    # over token chunks of `token_chunk` tokens ([token_chunk, V] f32 at a time, no recompute);
    # gspo (any objective registered with sequence_ratio=True) needs whole sequences first and
    # uses vocabulary chunks of `vocab_chunk` with a recomputing backward.
    token_chunk: int = 1024
    vocab_chunk: int = 8192  # gspo's vocabulary chunk (see token_chunk)
    # The LM head's matmul operands: "float32" (exact, the default: trainer logprobs match the
    # sampler's f32 head) or "bfloat16" (bf16 operands, f32 accumulation, as torch autocast
    # runs the head; faster where bf16 matmuls are, e.g. AMX, at ~1e-2 logprob error).
    head_dtype: str = "float32"

    def __post_init__(self):
        # ConfigError naming the registered objectives, or the fields a registration got wrong.
        objectives.get_objective(self.objective).options_from(self)
        _positive(
            "loss",
            tis_clip=self.tis_clip,
            temperature=self.temperature,
            token_chunk=self.token_chunk,
            vocab_chunk=self.vocab_chunk,
        )
        if self.correction not in correction_lib.CORRECTIONS:
            raise ConfigError(
                f"loss.correction={self.correction!r}; use one of {correction_lib.CORRECTIONS}"
            )
        if self.correction_applies not in correction_lib.APPLIES:
            raise ConfigError(
                f"loss.correction_applies={self.correction_applies!r}; use one of "
                f"{correction_lib.APPLIES}"
            )
        if not 0 < self.correction_low < 1 < self.correction_high:
            raise ConfigError(
                f"loss.correction_low={self.correction_low} and correction_high="
                f"{self.correction_high} must satisfy 0 < low < 1 < high"
            )
        if self.head_dtype not in HEAD_DTYPES:
            raise ConfigError(
                f"loss.head_dtype={self.head_dtype!r} must be float32, bfloat16 or float16"
            )
        for name in ("ppo_eps_low", "gspo_eps_low"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"loss.{name}={getattr(self, name)!r} must be in [0, 1)")
        if not 0 <= self.cispo_eps_low <= 1:
            raise ConfigError(f"loss.cispo_eps_low={self.cispo_eps_low!r} must be in [0, 1]")
        for name in ("ppo_eps_high", "gspo_eps_high", "cispo_eps_high"):
            if getattr(self, name) < 0:
                raise ConfigError(f"loss.{name}={getattr(self, name)!r} must be >= 0")
        for name in (
            "kl_coef",
            "entropy_coef",
            "kl_coef_end",
            "entropy_coef_end",
            "kl_schedule_steps",
            "entropy_schedule_steps",
        ):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"loss.{name}={value!r} must be >= 0")

    @property
    def uses_reference(self) -> bool:
        """Whether reference logprobs are ever needed (the trainer then keeps reference params)."""
        return self.kl_coef > 0 or (self.kl_coef_end or 0) > 0

    @property
    def fused(self) -> bool:
        """Per-token objectives take the fused head path; those that need the sequence ratio
        (gspo), or a sequence-level correction, need sequence sums first."""
        sequence_level = self.correction in correction_lib.SEQUENCE_LEVEL
        return not (objectives.get_objective(self.objective).sequence_ratio or sequence_level)


def linear_schedule(start: float, end: float | None, steps: int, step):
    """start -> end linearly over `steps` steps, then end; constant `start` when end is None."""
    if end is None or steps <= 0:
        return start if end is None else end
    frac = jnp.clip(jnp.asarray(step, jnp.float32) / steps, 0.0, 1.0)
    return start + (end - start) * frac
