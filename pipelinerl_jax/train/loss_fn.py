"""The step's loss: the Trainer's own (`rl_loss`: the model forward, then the registered
objective of rl/objectives.py with its KL and entropy terms) and a researcher's `loss_fn`.

`rl_loss` runs inside the jitted step once per micro-batch; `default_loss_fn` gives the same
loss as a `loss_fn(params, batch)` to wrap or compare against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import attention, decoder
from pipelinerl_jax.rl import losses
from pipelinerl_jax.rl.batch import TrainBatch
from pipelinerl_jax.rl.config import LossConfig
from pipelinerl_jax.rl.logprobs import chunked_logprobs
from pipelinerl_jax.train.config import TrainerConfig

# A loss a researcher writes: loss_fn(params, batch) -> (loss, aux). `params` is the model's
# nnx.State (differentiated), `batch` a TrainBatch (rl/batch.py documents its fields; inside
# the step its token fields may be one micro-batch's rows). `loss` is the scalar to
# differentiate, a sum over the batch's tokens (micro-batches add up); `aux` a dict of
# additive sums (summed over micro-batches, "max_" keys by maximum) that become metrics. A
# step whose loss or gradient is not finite is skipped.
LossFn = Callable[[Any, TrainBatch], tuple[jax.Array, dict]]


def default_loss_fn(cfg: TrainerConfig, graphdef, ref_params=None) -> LossFn:
    """The Trainer's own loss as a `loss_fn(params, batch)`, to wrap or compare against.

    cfg.loss's objective with its KL and entropy terms at their starting coefficients (the
    Trainer's built-in loss also follows their schedules); ref_params: the KL term's frozen
    reference params (needed when cfg.loss has a KL term). E.g. the default plus a penalty:

        base = default_loss_fn(cfg, graphdef)

        def loss_fn(params, batch):
            loss, aux = base(params, batch)
            extra = penalty(params)
            return loss + extra, {**aux, "loss": aux["loss"] + extra, "penalty": extra}
    """
    if cfg.loss.uses_reference and ref_params is None:
        raise ConfigError("default_loss_fn: cfg.loss has a KL term (kl_coef > 0); pass ref_params")
    kw = dict(
        graphdef=graphdef,
        loss_cfg=cfg.loss,
        kl_coef=cfg.loss.kl_coef,
        entropy_coef=cfg.loss.entropy_coef,
        attention_block=cfg.attention_block,
    )
    ref = ref_params if cfg.loss.uses_reference else None
    return lambda params, batch: rl_loss(params, ref, batch, **kw)


def rl_loss(
    params,
    ref_params,
    batch: TrainBatch,
    *,
    graphdef,
    loss_cfg: LossConfig,
    kl_coef,
    entropy_coef,
    attention_block: int,
    version=None,
    layer_grads_into=None,
):
    """(loss, stats) of one (micro-)batch: the Trainer's loss unless it is given `loss_fn=`.

    `ref_params` are the frozen reference params when loss_cfg uses a KL term, else None.
    kl_coef and entropy_coef are this step's scheduled values (traced scalars), version the
    trainer's (each token's lag, for the rollout correction); graphdef,
    loss_cfg and attention_block are the Trainer's. `stats` holds additive sums that
    losses.finalize turns into metrics, "loss" among them. Traced inside the jitted step, once
    per micro-batch. layer_grads_into: the step's accumulator of the layers' gradients, whose
    own cotangent is then itself plus this micro-batch's layer gradients, added in place
    (decoder.forward_hidden).
    """
    if attention_block > 0:
        attend = attention.blocked_causal_attention(
            batch.segment_ids, attention_block, batch.prefix_ids
        )
    else:
        attend = attention.segment_causal_attention(batch.segment_ids, batch.prefix_ids)
    ref_lp = None
    if ref_params is not None:
        ref_hidden, _ = decoder.forward_hidden(
            graphdef, ref_params, batch.tokens, batch.positions, attend=attend
        )
        ref_lp, _ = chunked_logprobs(
            ref_hidden,
            decoder.lm_head_weight(ref_params),
            batch.targets,
            temperature=loss_cfg.temperature,
            vocab_chunk=loss_cfg.vocab_chunk,
            head_dtype=loss_cfg.head_dtype,
        )
        ref_lp = jax.lax.stop_gradient(ref_lp)
    hidden, _ = decoder.forward_hidden(
        graphdef,
        params,
        batch.tokens,
        batch.positions,
        attend=attend,
        layer_grads_into=layer_grads_into,
    )
    return losses.loss_from_hidden(
        loss_cfg,
        hidden,
        decoder.lm_head_weight(params),
        batch,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        ref_logprobs=ref_lp,
        num_sequences=batch.num_sequences,
        version=version,
    )


def wrap_loss_fn(loss_fn: LossFn, params, ref_params, batch):
    """A researcher's loss_fn(params, batch) in the step's (params, ref, batch) form."""
    del ref_params  # the reference model belongs to the built-in loss's KL term
    out = loss_fn(params, batch)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise TypeError(
            f"loss_fn(params, batch) must return (loss, aux_dict), got {type(out).__name__}"
        )
    loss, aux = out
    return loss, {"loss": loss, **aux}
