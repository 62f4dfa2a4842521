"""ModelConfig: the frozen, hashable description of a decoder of any registered family.

Read from and written to a Hugging Face `config.json` by models/hf_config.py (which knows the
families; this module sits below them). Being a frozen dataclass of hashable fields, it can be
a jit static argument and lives in the NNX graphdef. The model_type is checked against the
families wherever one is looked up (models/registry.family_of).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import rope
from pipelinerl_jax.models.lora import LoraConfig, check_rank, lora_config
from pipelinerl_jax.models.remat import REMAT_POLICIES

_DTYPES = ("float32", "bfloat16")


def hashable(value: Any) -> Any:
    """dicts and lists as sorted tuples, so a config field holding them can be hashed."""
    if isinstance(value, dict):
        return tuple(sorted((k, hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(hashable(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture plus dtype/remat choices. Letters: E hidden, F mlp, H q heads, K kv heads, D head."""

    model_type: str  # a registry.MODEL_TYPES entry: "llama", "qwen2", "qwen3", "mistral", "gemma"
    vocab_size: int  # V
    hidden_size: int  # E
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # H (query heads)
    num_kv_heads: int  # K
    head_dim: int  # D
    rms_norm_eps: float  # RMSNorm epsilon
    rope_theta: float  # RoPE base frequency
    rope_scaling: tuple | None  # sorted ((key, value), ...) of HF rope_scaling, or None
    max_position_embeddings: int  # longest position the model was built for
    tie_word_embeddings: bool  # the LM head reuses the token embedding
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    param_dtype: str = "float32"  # "float32" | "bfloat16"
    compute_dtype: str = "float32"  # "float32" | "bfloat16"; logits and log-softmax always f32
    remat: bool = False  # rematerialise each layer in the backward pass
    remat_policy: str = "attention"  # what a rematerialised layer keeps: a REMAT_POLICIES name
    bos_token_id: int | None = None  # from the HF config; None: none
    eos_token_id: int | tuple[int, ...] | None = None  # one id or several (HF config)
    lora: LoraConfig | None = None  # LoRA adapters in the param table (models/lora.py)

    def __post_init__(self):
        # A dict (config), or the sorted pairs a JSON round trip leaves (train/json_items.py).
        lora = dict(self.lora) if isinstance(self.lora, tuple) else self.lora
        object.__setattr__(self, "lora", lora_config(lora))
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is not supported; use one of {_DTYPES}"
                )
        if self.remat_policy not in REMAT_POLICIES:
            raise ConfigError(
                f"remat_policy={self.remat_policy!r} is not supported; use one of "
                f"{tuple(REMAT_POLICIES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"config.json: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; fix the config"
            )
        if self.head_dim % 2:
            raise ConfigError(f"config.json: head_dim={self.head_dim} must be even for RoPE")
        # Validates the rope type early (one-line error for yarn, dynamic, ...).
        rope.check_rope_scaling(self.rope_scaling)
        if self.lora is not None:
            check_rank(self.lora, self.projection_features)

    @property
    def projection_features(self) -> dict[str, tuple[int, int]]:
        """Each layer projection's (input, output) features."""
        e, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (e, q),
            "k_proj": (e, kv),
            "v_proj": (e, kv),
            "o_proj": (q, e),
            "gate_proj": (e, f),
            "up_proj": (e, f),
            "down_proj": (f, e),
        }

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)
