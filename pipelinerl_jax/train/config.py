"""TrainerConfig: the optimizer, accumulation and failure policy (light: no JAX program)."""

from __future__ import annotations

import dataclasses

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rl.config import LossConfig


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Optimizer, accumulation and failure policy. Defaults: the paper's headline run."""

    learning_rate: float = 1e-6  # AdamW peak learning rate (after warm-up)
    lr_schedule: str = "cosine"  # "cosine" (to min_lr_ratio * lr at total_steps) | "constant"
    warmup_steps: int = 50  # linear warm-up from 0 over this many steps
    total_steps: int = 1000  # the schedule's length (the run config sets its steps)
    min_lr_ratio: float = 0.0  # cosine: the final lr as a fraction of learning_rate
    b1: float = 0.9  # AdamW first-moment decay
    b2: float = 0.999  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    weight_decay: float = 0.01  # not applied to norms and biases
    grad_clip_norm: float = 0.3  # global-norm clipping; 0 disables
    micro_batches: int = 1  # gradient accumulation steps per optimizer step
    # With micro_batches > 1: the layers' gradients are added into the accumulator in place
    # by the backward (models/accumulating_scan.py), so no second full-model gradient is held.
    # Applies to the built-in loss without LoRA; same values either way.
    accumulate_in_place: bool = True
    max_consecutive_skips: int = 5  # non-finite steps in a row before check_skips stops the run
    # Causal attention in query blocks of about this many rows (at most 16 blocks), each block
    # attending only to keys up to its end: ~half the score work and memory of a full T x T
    # mask. 0 uses the model's plain segment_causal_attention.
    attention_block: int = 128
    loss: LossConfig = LossConfig()

    def __post_init__(self):
        if self.lr_schedule not in ("cosine", "constant"):
            raise ConfigError(
                f"trainer.lr_schedule={self.lr_schedule!r}; use 'cosine' or 'constant'"
            )
        if not self.learning_rate > 0:
            raise ConfigError(f"trainer.learning_rate={self.learning_rate!r} must be > 0")
        if self.micro_batches < 1 or self.max_consecutive_skips < 1:
            raise ConfigError(
                "trainer.micro_batches and trainer.max_consecutive_skips must be >= 1"
            )
        if self.warmup_steps < 0 or self.total_steps < 1 or self.grad_clip_norm < 0:
            raise ConfigError("trainer: warmup_steps >= 0, total_steps >= 1, grad_clip_norm >= 0")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name}={getattr(self, name)} must be in [0, 1)")
        if not self.eps > 0:
            raise ConfigError(
                f"trainer.eps={self.eps} must be > 0: AdamW divides by sqrt(nu) + eps, and nu is "
                "0 for a parameter whose gradient is 0"
            )
        if self.weight_decay < 0:
            raise ConfigError(f"trainer.weight_decay={self.weight_decay} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(
                f"trainer.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] (the final lr as "
                "a fraction of learning_rate)"
            )
        if self.attention_block < 0:
            raise ConfigError(
                f"trainer.attention_block={self.attention_block} must be >= 0 (0: plain "
                "causal attention)"
            )
