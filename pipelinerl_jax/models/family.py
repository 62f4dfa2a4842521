"""What makes a model family: its config.json dialect, its parameter table and its block math.

A `Family` is data plus a few pure functions; the decoder (decoder.py), checkpoint I/O and the
sampler read everything family-specific through it, so a new family is one module in models/
defining a `Family` and one entry in registry.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    architectures: dict[str, str]  # HF model_type -> its `architectures` entry
    norm: Callable  # norm(x, weight, eps, axis=-1): the RMSNorm variant (block.py)
    activation: Callable  # the gated MLP's activation
    scale_embeddings: bool  # multiply token embeddings by sqrt(hidden_size)
    param_table: Callable  # param_table(cfg) -> tuple[params.ParamSpec, ...]
    # hf_fields(config_json_dict) -> {ModelConfig field: value} for what this family decides
    # (bias, qk-norm, defaults it differs on); raises ConfigError on what it cannot run.
    hf_fields: Callable[[dict], dict[str, Any]]
    hf_extras: Callable  # hf_extras(cfg) -> config.json keys this family writes
