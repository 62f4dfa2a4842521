"""Rotary position embeddings (RoPE): inverse frequencies, scaling variants, application.

Matches Hugging Face's "rotate half" convention (the two halves of each head are the real and
imaginary parts), frequencies computed in float32 as transformers does. Scaling types:
"default", "linear" and "llama3"; others ("dynamic", "yarn", "longrope", ...) are refused with a
one-line error, because silently using default RoPE would give a different model.

Letters (pipelinerl_jax/__init__.py): B batch, T tokens, H heads (query or kv), D head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def check_rope_scaling(rope_scaling: tuple | dict | None) -> None:
    """Raises ConfigError for rope scaling types this port does not implement."""
    if rope_scaling is None:
        return
    scaling = dict(rope_scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config.json: rope_scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)} (remove rope_scaling or convert the model)"
        )
    if rope_type == "linear" and "factor" not in scaling:
        raise ConfigError("config.json: rope_scaling type 'linear' needs a 'factor'")
    if rope_type == "llama3":
        missing = {
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        } - scaling.keys()
        if missing:
            raise ConfigError(
                f"config.json: rope_scaling type 'llama3' is missing {sorted(missing)}"
            )


def inv_frequencies(head_dim: int, theta: float, rope_scaling: tuple | dict | None) -> np.ndarray:
    """Per-pair inverse frequencies [D/2] (float32), with the configured scaling applied."""
    check_rope_scaling(rope_scaling)
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if rope_scaling is None:
        return inv_freq
    scaling = dict(rope_scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, smooth between."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_context = float(s["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def cos_sin(positions_BxT: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [B, T, D/2] for integer positions, computed in f32, cast to `dtype`."""
    angles_BxTxD2 = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles_BxTxD2).astype(dtype), jnp.sin(angles_BxTxD2).astype(dtype)


def apply(x_BxTxHxD: jax.Array, cos_BxTxD2: jax.Array, sin_BxTxD2: jax.Array) -> jax.Array:
    """Rotates each (x[i], x[i + D/2]) pair by the position's angle (HF rotate_half layout)."""
    half = x_BxTxHxD.shape[-1] // 2
    x1, x2 = x_BxTxHxD[..., :half], x_BxTxHxD[..., half:]
    cos, sin = cos_BxTxD2[:, :, None, :], sin_BxTxD2[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
