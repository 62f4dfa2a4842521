"""The Gemma family (Gemma 1: GemmaForCausalLM), on the shared block and parameter table.

What differs from Llama is math, not names: RMSNorm scales by (1 + w) in f32 (HF stores w,
zero at init), the gated MLP uses tanh-approximated GELU, token embeddings are multiplied by
sqrt(hidden_size), and the LM head is the tied embedding.
"""

from __future__ import annotations

import functools

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import block, params
from pipelinerl_jax.models.family import Family

# transformers maps Gemma's legacy "gelu" to the tanh approximation the model was trained with.
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def _hf_fields(c: dict) -> dict:
    act = c.get("hidden_activation") or c.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ConfigError(
            f"config.json: hidden_act={act!r} is not supported for gemma; only 'gelu_pytorch_tanh'"
        )
    if c.get("attention_bias"):
        raise ConfigError("config.json: attention_bias=true is not supported for gemma")
    return {
        "attention_bias": False,
        "qk_norm": False,
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", True)),
    }


def _hf_extras(cfg) -> dict:
    return {"hidden_act": "gelu_pytorch_tanh", "attention_bias": False}


FAMILY = Family(
    name="gemma",
    architectures={"gemma": "GemmaForCausalLM"},
    norm=block.rms_norm_plus_one,
    activation=block.gelu_tanh,
    scale_embeddings=True,
    param_table=functools.partial(params.decoder_params, norm_init="zeros"),
    hf_fields=_hf_fields,
    hf_extras=_hf_extras,
)
