"""Architectures of public checkpoints, as their config.json states them: shapes without weights.

The ahead-of-time GPU compile and the planner need a 7B model's shapes, not its 15 GB of
weights: `known_config("qwen2.5-7b")` is the ModelConfig that `ModelConfig.from_hf` builds from
that checkpoint's config.json, and `decoder.abstract_init` turns it into parameter shapes.
`tiny(...)`-sized test models live in the tests; these are the real sizes.
"""

from __future__ import annotations

from pipelinerl_jax.models import config_json
from pipelinerl_jax.models.config import ModelConfig

__all__ = ["KNOWN_HF_CONFIGS", "known_config"]

# The config.json fields ModelConfig reads, copied from each checkpoint's published config.
KNOWN_HF_CONFIGS = {
    "smollm2-135m": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # Qwen2.5-7B's 28 query heads do not split over 8 devices; this one's 32 / 8 do.
    "llama3.1-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128009,
    },
}


def known_config(name: str, **overrides) -> ModelConfig:
    """The named checkpoint's ModelConfig (dtype and remat fields from `overrides`)."""
    key = name.lower()
    if key not in KNOWN_HF_CONFIGS:
        raise ValueError(f"unknown model {name!r}: known shapes are {sorted(KNOWN_HF_CONFIGS)}")
    return config_json.from_hf(KNOWN_HF_CONFIGS[key], **overrides)
