"""The parameter table is the one source: the module's params, counts, HF names and every
tensor-parallel split follow from it; the registry names every family's model types."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax import sharding
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, param_counts, registry
from pipelinerl_jax.models import params as param_table
from tests.tiny_models import model_config

CFG = model_config(
    model_type="qwen3",
    vocab_size=48,
    hidden_size=16,
    intermediate_size=40,
    num_layers=3,
    rms_norm_eps=1e-6,
    attention_bias=True,
    qk_norm=True,
)
TP_LOGICAL = frozenset(name for name, axis in sharding.RULES if axis == sharding.TP)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma"])
def test_module_params_follow_the_table(model_type):
    cfg = dataclasses.replace(CFG, model_type=model_type)
    specs = decoder.param_specs(cfg)
    _, params = decoder.init(cfg, jax.random.key(0))
    flat = {"/".join(map(str, path)): var for path, var in nnx.to_flat_state(params)}
    assert set(flat) == {s.key for s in specs}
    for s in specs:
        var = flat[s.key]
        assert var.get_value().shape == param_table.shape_of(s, cfg), s.key
        assert var.get_metadata()["out_sharding"] == s.axes, s.key
        if s.init != "normal":  # Gemma's (1 + w) norms start at 0, Llama's w norms at 1
            want = 0.0 if model_type == "gemma" else 1.0
            np.testing.assert_array_equal(var.get_value(), want)
    leaves = sum(int(np.prod(v.get_value().shape)) for v in flat.values())
    assert param_counts.num_params(cfg) == leaves


def test_output_major_tp_split_is_megatrons():
    """Column split (output heads / MLP columns) for q/k/v/gate/up and the q/k/v biases, row
    split (input columns, partial sums) for o_proj and down, nothing for norms."""
    want = {
        "q_proj": 0,
        "k_proj": 0,
        "v_proj": 0,
        "gate_proj": 0,
        "up_proj": 0,
        "o_proj": 1,
        "down_proj": 1,
        "q_bias": 0,
        "k_bias": 0,
        "v_bias": 0,
        "attn_norm": None,
        "mlp_norm": None,
        "q_norm": None,
        "k_norm": None,
    }
    got = {
        s.name: param_table.tp_dim(s, TP_LOGICAL, output_major=True)
        for s in decoder.param_specs(CFG)
        if s.per_layer
    }
    assert got == want
    # As stored (input-major), the split dim is where the heads / MLP axis sits.
    stored = {
        s.name: param_table.tp_dim(s, TP_LOGICAL, output_major=False)
        for s in decoder.param_specs(CFG)
        if s.per_layer
    }
    assert stored["q_proj"] == 1 and stored["o_proj"] == 0 and stored["down_proj"] == 0


def test_unknown_model_type_names_every_family():
    with pytest.raises(ConfigError, match="gemma") as e:
        registry.family_of("gpt2")
    assert "llama" in str(e.value) and "'gpt2'" in str(e.value)
    assert set(registry.MODEL_TYPES) >= {"llama", "qwen2", "qwen3", "mistral", "gemma"}
