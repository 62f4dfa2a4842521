"""The model families the project runs, by Hugging Face `model_type`.

Adding a family: a module in models/ that defines a `family.Family`, and its entry in FAMILIES.
"""

from __future__ import annotations

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import gemma, llama
from pipelinerl_jax.models.family import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, gemma.FAMILY)

_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.architectures}
MODEL_TYPES = tuple(_BY_MODEL_TYPE)


def family_of(model_type: str) -> Family:
    """The family of a config.json `model_type`; ConfigError naming the supported ones."""
    try:
        return _BY_MODEL_TYPE[model_type]
    except KeyError:
        raise ConfigError(
            f"config.json: model_type {model_type!r} is not supported; "
            f"use one of {', '.join(MODEL_TYPES)}"
        ) from None
