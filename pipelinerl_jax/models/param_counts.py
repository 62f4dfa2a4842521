"""Parameter counts of a ModelConfig, from its family's parameter table."""

from __future__ import annotations

import math

from pipelinerl_jax.models import params
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.models.registry import family_of


def num_params(cfg: ModelConfig) -> int:
    """Parameters in the family's table for this config."""
    table = family_of(cfg.model_type).param_table(cfg)
    return sum(math.prod(params.shape_of(s, cfg)) for s in table)


def num_layer_params(cfg: ModelConfig) -> int:
    """Parameters stacked along the layer axis (the decoder blocks'), all layers together."""
    table = family_of(cfg.model_type).param_table(cfg)
    return sum(math.prod(params.shape_of(s, cfg)) for s in table if s.per_layer)


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights touched by matmuls for one token (the LM head included, the embedding lookup
    not): FLOPs = 2x this."""
    table = family_of(cfg.model_type).param_table(cfg)
    per_layer = sum(math.prod(params.shape_of(s, cfg)) for s in table if s.per_layer and s.n_in)
    return per_layer + cfg.hidden_size * cfg.vocab_size


def num_adapter_params(cfg: ModelConfig) -> int:
    """Parameters of the LoRA adapters (cfg.lora), 0 without them."""
    if cfg.lora is None:
        return 0
    base = family_of(cfg.model_type).param_table(cfg)
    return sum(math.prod(params.shape_of(s, cfg)) for s in params.lora_params(cfg.lora, base))
