"""The Llama family: Llama 2/3.x, Qwen2/2.5, Qwen3 dense and Mistral checkpoints.

They share one parameter table (params.decoder_params) and one block (block.py) with
Llama's RMSNorm and SiLU; Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm on q and k.
"""

from __future__ import annotations

import jax

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import block, params
from pipelinerl_jax.models.family import Family


def _hf_fields(c: dict) -> dict:
    model_type = c["model_type"]
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act={act!r} is not supported; only 'silu'")
    if c.get("mlp_bias"):
        raise ConfigError("config.json: mlp_bias=true is not supported; only bias-free MLPs")
    if model_type == "qwen2":
        attention_bias = True  # Qwen2 always has q/k/v bias and no o_proj bias.
    else:
        attention_bias = bool(c.get("attention_bias", False))
        if attention_bias:
            raise ConfigError(
                f"config.json: attention_bias=true for model_type {model_type!r} (bias on o_proj "
                "too) is not supported; only Qwen2-style q/k/v bias is"
            )
    return {"attention_bias": attention_bias, "qk_norm": model_type == "qwen3"}


def _hf_extras(cfg) -> dict:
    out = {"hidden_act": "silu"}
    if cfg.model_type in ("llama", "qwen3"):
        out["attention_bias"] = False
    if cfg.model_type == "llama":
        out["mlp_bias"] = False
    if cfg.model_type in ("qwen2", "qwen3"):
        out["use_sliding_window"] = False
    if cfg.model_type in ("qwen2", "qwen3", "mistral"):
        out["sliding_window"] = None
    return out


FAMILY = Family(
    name="llama",
    architectures={
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
    },
    norm=block.rms_norm,
    activation=jax.nn.silu,
    scale_embeddings=False,
    param_table=params.decoder_params,
    hf_fields=_hf_fields,
    hf_extras=_hf_extras,
)
