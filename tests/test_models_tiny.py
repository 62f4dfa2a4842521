"""models.tiny: a small random model of each family that runs, differs by seed, and takes
any ModelConfig override."""

import jax
import numpy as np
import pytest

from pipelinerl_jax import models
from pipelinerl_jax.models import decoder, param_counts


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gemma"])
def test_tiny_model_of_each_family_runs(model_type):
    cfg, graphdef, params = models.tiny(model_type)
    assert decoder.config_of(graphdef) == cfg and cfg.model_type == model_type
    assert sum(x.size for x in jax.tree.leaves(params)) == param_counts.num_params(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, cfg.vocab_size)
    logits = decoder.forward(graphdef, params, tokens, np.arange(5)[None].repeat(2, 0))
    assert logits.shape == (2, 5, cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()


def test_overrides_and_seeds():
    cfg, _, a = models.tiny("qwen2", num_layers=1, vocab_size=128, seed=3)
    assert (cfg.num_layers, cfg.vocab_size, cfg.attention_bias) == (1, 128, True)
    _, _, b = models.tiny("qwen2", num_layers=1, vocab_size=128, seed=4)
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert any(not np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
    assert models.tiny_config(head_dim=16).head_dim == 16
    with pytest.raises(AttributeError, match="no attribute 'tinyy'"):
        models.tinyy  # noqa: B018
