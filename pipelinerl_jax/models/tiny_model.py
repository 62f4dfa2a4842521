"""A small random model of any registered family, for examples, notebooks and tests.

    cfg, graphdef, params = models.tiny()                       # a 2-layer llama, V = 64
    cfg, graphdef, params = models.tiny("qwen2", num_layers=1, vocab_size=128, seed=3)

Sizes are the smallest that exercise every code path of the family (grouped-query attention,
RoPE, an untied head); any ModelConfig field can be overridden.
"""

from __future__ import annotations

import jax

from pipelinerl_jax.models import decoder
from pipelinerl_jax.models.config import ModelConfig

# Per-family switches a Hugging Face config would set (Qwen2: q/k/v bias; Qwen3: qk-norm).
_FAMILY_FIELDS = {"qwen2": {"attention_bias": True}, "qwen3": {"qk_norm": True}}


def tiny_config(model_type: str = "llama", **overrides) -> ModelConfig:
    """The ModelConfig `tiny` builds: hidden 32, 2 layers, 4 query / 2 kv heads of dim 8."""
    fields = dict(
        model_type=model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
    )
    fields.update(_FAMILY_FIELDS.get(model_type, {}))
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny(model_type: str = "llama", *, seed: int = 0, **overrides):
    """(cfg, graphdef, params): tiny_config's model with random weights from `seed`."""
    cfg = tiny_config(model_type, **overrides)
    graphdef, params = decoder.init(cfg, jax.random.key(seed))
    return cfg, graphdef, params
