"""The JSON items of a checkpoint: the caller's `extra` dict and the ModelConfig in `meta`.

    extra = jsonable(dict(extra), "")                   # TypeError names the offending key
    meta["model_config"] = model_config_to_json(cfg)    # tuples become lists
    cfg = model_config_from_json(meta["model_config"])  # lists back to tuples

Orbax writes these items with its JSON handler, which takes only plain JSON values: numpy
scalars and arrays, jax arrays and dataclasses are converted here, and anything else is refused
with the path of the value, so a bad `extra` fails at `save` with a message that names it
rather than in a background write.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pipelinerl_jax.models.config import ModelConfig


def jsonable(value: Any, where: str) -> Any:
    """A JSON-safe copy (numpy scalars/arrays become numbers/lists); TypeError names the key."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, jax.Array)):
        return np.asarray(value).tolist()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: jsonable(getattr(value, f.name), f"{where}.{f.name}")
            for f in dataclasses.fields(value)
        }
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"checkpoint extra{where}: key {k!r} is not a string (JSON keys are)"
                )
            out[k] = jsonable(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"checkpoint extra{where} is a {type(value).__name__}, which JSON cannot "
        "store; convert it to numbers, strings, lists or dicts"
    )


def model_config_to_json(cfg: ModelConfig) -> dict:
    return jsonable(cfg, "")


def _tuples(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _tuples(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def model_config_from_json(d: dict) -> ModelConfig:
    """Inverse of model_config_to_json (lists back to the tuples ModelConfig hashes)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: _tuples(v) for k, v in d.items() if k in fields})
