"""ModelConfig: the frozen, hashable description of a decoder of any registered family.

Built from a Hugging Face `config.json` dict with `ModelConfig.from_hf` (both the legacy
`rope_theta`/`rope_scaling` keys and transformers 5's `rope_parameters` are understood) and
written back with `to_hf`. Being a frozen dataclass of hashable fields, it can be a jit static
argument and lives in the NNX graphdef.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models.remat import REMAT_POLICIES

_DTYPES = ("float32", "bfloat16")


def _hashable(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
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

    def __post_init__(self):
        _family(self.model_type)  # one line naming the supported types if unknown
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
        from pipelinerl_jax.models import rope

        rope.check_rope_scaling(self.rope_scaling)

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf(cls, hf_config: dict, **overrides) -> ModelConfig:
        """Parses a Hugging Face config.json dict; `overrides` replace any field afterwards."""
        c = dict(hf_config)
        family = _family(c.get("model_type"))
        try:
            hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
            cfg_fields = dict(
                model_type=c["model_type"],
                vocab_size=int(c["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(c["intermediate_size"]),
                num_layers=int(c["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or hidden // heads),
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                bos_token_id=c.get("bos_token_id"),
                eos_token_id=_hashable(c.get("eos_token_id")),
            )
        except KeyError as e:
            raise ConfigError(
                f"config.json: missing key {e.args[0]!r}; is this a decoder config?"
            ) from None
        cfg_fields.update(family.hf_fields(c))
        cfg_fields["rope_theta"], cfg_fields["rope_scaling"] = _parse_rope(c)
        cfg_fields.update(overrides)
        _check_sliding_window(c, cfg_fields["max_position_embeddings"])
        return cls(**cfg_fields)

    def to_hf(self) -> dict:
        """A config.json dict that transformers (4.x and 5.x) and vLLM load as the same model."""
        rope_scaling = self.rope_scaling_dict
        out = {
            "architectures": [_family(self.model_type).architectures[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.param_dtype,  # transformers 4.x name
            "dtype": self.param_dtype,  # transformers 5.x name
            "use_cache": True,
        }
        params = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": self.rope_theta}
        out["rope_parameters"] = params
        out.update(_family(self.model_type).hf_extras(self))
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            out["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
        return out

    def num_params(self) -> int:
        """Parameters in the family's table for this config."""
        from pipelinerl_jax.models import params

        table = _family(self.model_type).param_table(self)
        return sum(math.prod(params.shape_of(s, self)) for s in table)

    def matmul_params_per_token(self) -> int:
        """Weights touched by matmuls for one token (the LM head included, the embedding lookup
        not): FLOPs = 2x this."""
        from pipelinerl_jax.models import params

        table = _family(self.model_type).param_table(self)
        per_layer = sum(
            math.prod(params.shape_of(s, self)) for s in table if s.per_layer and s.n_in
        )
        return per_layer + self.hidden_size * self.vocab_size


def _family(model_type):
    # Imported here: the family modules import this one's dependants (block, params).
    from pipelinerl_jax.models import registry

    return registry.family_of(model_type)


def _parse_rope(c: dict) -> tuple[float, tuple | None]:
    """(rope_theta, hashable rope_scaling) from legacy keys or transformers 5 `rope_parameters`."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(c.get("rope_theta", 10000.0))
        scaling = dict(c.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if not scaling or scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, _hashable(scaling)


def _check_sliding_window(c: dict, max_positions: int) -> None:
    """Sliding-window attention is not implemented: refuse only where it would change results."""
    window = c.get("sliding_window")
    layer_types = c.get("layer_types") or ()
    if c.get("model_type") in ("qwen2", "qwen3"):
        uses_window = bool(c.get("use_sliding_window")) or "sliding_attention" in layer_types
    else:
        uses_window = window is not None
    if uses_window and window is not None and int(window) < max_positions:
        raise ConfigError(
            f"config.json: sliding_window={window} < max_position_embeddings={max_positions}; "
            "sliding-window attention is not supported: load with "
            f"max_position_embeddings={window} (an override) to use contexts up to the window"
        )
