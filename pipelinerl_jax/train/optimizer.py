"""The Trainer's default optimizer: AdamW with a warm-up then cosine or constant learning
rate, and weight decay on everything but norm scales and biases (global-norm clipping is in
the train step, trainer.py, with the norm it reports)."""

from __future__ import annotations

import jax
import optax

from pipelinerl_jax.train.config import TrainerConfig


def learning_rate_schedule(cfg: TrainerConfig) -> optax.Schedule:
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1))
    if cfg.lr_schedule == "constant":
        after = optax.constant_schedule(cfg.learning_rate)
    else:
        after = optax.cosine_decay_schedule(
            cfg.learning_rate, max(cfg.total_steps - cfg.warmup_steps, 1), alpha=cfg.min_lr_ratio
        )
    if cfg.warmup_steps == 0:
        return after
    return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def decay_mask(params):
    """True for params that get weight decay: everything but norm scales and biases."""

    def keep(path, _):
        name = jax.tree_util.keystr(path)
        return "norm" not in name and "bias" not in name

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: TrainerConfig) -> optax.GradientTransformation:
    """AdamW with the schedule and decay mask. Global-norm clipping happens in the step, with
    the same norm it reports (one reduction per leaf instead of two)."""
    return optax.adamw(
        learning_rate_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
