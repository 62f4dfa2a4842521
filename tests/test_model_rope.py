"""RoPE: inverse frequencies equal transformers' for default, linear and llama3; rotation by hand."""

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import rope

HEAD_DIM = 64
CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    # Llama 3.1's values: all three regions (kept, smoothed, divided) occur at head_dim 64.
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


@pytest.mark.parametrize("name", list(CASES))
def test_inv_frequencies_match_transformers(name):
    scaling = CASES[name]
    theta = 500000.0
    ours = rope.inv_frequencies(HEAD_DIM, theta, scaling)
    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 2, num_attention_heads=2, rope_theta=theta, rope_scaling=scaling
    )
    if scaling is None:
        ref = 1.0 / (theta ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    else:
        ref, attention_factor = ROPE_INIT_FUNCTIONS[name](config, "cpu")
        assert attention_factor == 1.0
        ref = ref.numpy()
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    if name == "llama3":
        base = rope.inv_frequencies(HEAD_DIM, theta, None)
        ratio = base / ours
        assert np.isclose(ratio, 1.0).any() and np.isclose(ratio, 8.0).any()
        assert ((ratio > 1.01) & (ratio < 7.99)).any()  # the smoothed band


def test_apply_rotates_half_pairs_by_hand():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    inv_freq = np.array([1.0, 0.1], np.float32)
    positions = jnp.asarray([[0, 1, 5]])
    cos, sin = rope.cos_sin(positions, inv_freq, jnp.float32)
    out = np.asarray(rope.apply(jnp.asarray(x), cos, sin))
    for t, pos in enumerate([0, 1, 5]):
        for i, f in enumerate(inv_freq):
            a, b = x[0, t, :, i], x[0, t, :, i + 2]
            c, s = np.cos(pos * f), np.sin(pos * f)
            np.testing.assert_allclose(out[0, t, :, i], a * c - b * s, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(out[0, t, :, i + 2], b * c + a * s, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0},
        {"type": "dynamic", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0},
    ],
)
def test_unsupported_or_incomplete_scaling(scaling):
    with pytest.raises(ConfigError, match="rope_scaling"):
        rope.inv_frequencies(HEAD_DIM, 1e4, scaling)
