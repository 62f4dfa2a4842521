"""ModelConfig <-> a Hugging Face `config.json` dict, in each family's dialect.

`from_hf` understands both the legacy `rope_theta`/`rope_scaling` keys and transformers 5's
`rope_parameters`; `to_hf` writes a dict that transformers (4.x and 5.x) and vLLM load as the
same model. Above the family registry, which ModelConfig itself cannot import (the families'
blocks and param tables import ModelConfig).
"""

from __future__ import annotations

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import config
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.models.registry import family_of


def from_hf(hf_config: dict, **overrides) -> ModelConfig:
    """Parses a Hugging Face config.json dict; `overrides` replace any field afterwards."""
    c = dict(hf_config)
    family = family_of(c.get("model_type"))
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
            eos_token_id=config.hashable(c.get("eos_token_id")),
        )
    except KeyError as e:
        raise ConfigError(
            f"config.json: missing key {e.args[0]!r}; is this a decoder config?"
        ) from None
    cfg_fields.update(family.hf_fields(c))
    cfg_fields["rope_theta"], cfg_fields["rope_scaling"] = _parse_rope(c)
    cfg_fields.update(overrides)
    _check_sliding_window(c, cfg_fields["max_position_embeddings"])
    return ModelConfig(**cfg_fields)


def to_hf(cfg: ModelConfig) -> dict:
    """A config.json dict that transformers (4.x and 5.x) and vLLM load as the same model."""
    rope_scaling = cfg.rope_scaling_dict
    out = {
        "architectures": [family_of(cfg.model_type).architectures[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": cfg.param_dtype,  # transformers 4.x name
        "dtype": cfg.param_dtype,  # transformers 5.x name
        "use_cache": True,
    }
    params = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": cfg.rope_theta}
    out["rope_parameters"] = params
    out.update(family_of(cfg.model_type).hf_extras(cfg))
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        eos = cfg.eos_token_id
        out["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
    return out


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
    return theta, config.hashable(scaling)


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
