"""Hugging Face I/O: logits parity with transformers per family, export round trips, sharded index.

Tiny random checkpoints are created here with transformers (no downloads), saved with
save_pretrained(safe_serialization=True) and loaded with load_hf.

Tolerance (f32): the same f32 operations in a different order (XLA vs torch kernels, fused
vs unfused softmax) differ by a few ulps per op; through 2 layers the logits agree to ~1e-7
absolute on values of size ~0.5. We assert max|diff| <= 1e-5 * max|logit| + 1e-6, i.e. the
1e-5 relative bound of the issue; any wiring mistake (a transposed weight, wrong rope half,
missing bias or norm) moves logits by >1e-2.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pipelinerl_jax.models import decoder, hf_io

VOCAB = 160
T = 24
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
FAMILIES = {
    # llama: rope_scaling llama3 (long wavelengths scaled at these positions), untied head.
    "llama3_untied": (
        transformers.LlamaConfig,
        dict(rope_scaling=LLAMA3, rope_theta=500000.0, tie_word_embeddings=False),
    ),
    "llama_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True, head_dim=16)),
    "qwen2_bias_tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3_qknorm": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=False)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, tie_word_embeddings=False)),
    # gemma: (1 + w) norms, tanh GELU, sqrt(E)-scaled embeddings, head_dim != E / H.
    "gemma": (transformers.GemmaConfig, dict(head_dim=16, tie_word_embeddings=True)),
}
MODEL_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "gemma": transformers.GemmaForCausalLM,
}


def make_checkpoint(path, family: str, seed: int = 0):
    """Saves a random tiny model; norms and biases randomised too so that they matter."""
    config_cls, extra = FAMILIES[family]
    config = config_cls(**BASE, **extra)
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config.model_type](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def our_logits(graphdef, params, tokens: np.ndarray) -> np.ndarray:
    B, T_ = tokens.shape
    positions = np.broadcast_to(np.arange(T_), (B, T_))
    return np.asarray(
        decoder.jit_forward(graphdef, params, jnp.asarray(tokens), jnp.asarray(positions))
    )


def assert_close_f32(ours, ref):
    err = np.abs(ours - ref).max()
    bound = 1e-5 * np.abs(ref).max() + 1e-6
    assert err <= bound, f"max|diff| {err:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, (2, T))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tmp_path, tokens, family):
    model = make_checkpoint(tmp_path, family)
    cfg, graphdef, params = hf_io.load_hf(tmp_path)
    assert cfg.tie_word_embeddings == FAMILIES[family][1]["tie_word_embeddings"]
    assert cfg.attention_bias == (cfg.model_type == "qwen2")
    assert cfg.qk_norm == (cfg.model_type == "qwen3")
    assert_close_f32(our_logits(graphdef, params, tokens), torch_logits(model, tokens))


def test_llama3_rope_scaling_changes_logits(tmp_path, tokens):
    """Guards the rope test above: ignoring the scaling would be caught (logits move visibly)."""
    model = make_checkpoint(tmp_path, "llama3_untied")
    _, graphdef, params = hf_io.load_hf(tmp_path, config_overrides={"rope_scaling": None})
    ref = torch_logits(model, tokens)
    diff = np.abs(our_logits(graphdef, params, tokens) - ref).max()
    assert diff > 100 * (1e-5 * np.abs(ref).max() + 1e-6)


def test_bf16_close_to_f32(tmp_path, tokens):
    """bf16 params and compute: 8 mantissa bits, ~4e-3 relative per rounding; through 2 layers
    the logits stay within 5% of the largest f32 logit (measured ~1-2%)."""
    make_checkpoint(tmp_path, "qwen3_qknorm")
    _, g32, p32 = hf_io.load_hf(tmp_path)
    _, g16, p16 = hf_io.load_hf(tmp_path, param_dtype="bfloat16")
    assert jax.tree.leaves(p16)[0].dtype == jnp.bfloat16
    ref, low = our_logits(g32, p32, tokens), our_logits(g16, p16, tokens)
    assert low.dtype == np.float32
    err = np.abs(low - ref).max() / np.abs(ref).max()
    assert 0 < err < 5e-2, err


def test_export_loads_in_transformers_with_same_logits(tmp_path, tokens):
    make_checkpoint(tmp_path / "src", "llama3_untied")
    cfg, graphdef, params = hf_io.load_hf(tmp_path / "src")
    hf_io.save_hf(tmp_path / "out", cfg, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded).__name__ == "LlamaForCausalLM"
    assert_close_f32(torch_logits(reloaded, tokens), our_logits(graphdef, params, tokens))
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_id


@pytest.mark.parametrize("family", ["qwen2_bias_tied", "qwen3_qknorm", "gemma"])
def test_load_export_load_is_bit_identical(tmp_path, family):
    make_checkpoint(tmp_path / "src", family)
    for dtype in ("float32", "bfloat16"):
        cfg, _, params = hf_io.load_hf(tmp_path / "src", param_dtype=dtype)
        hf_io.save_hf(tmp_path / dtype, cfg, params)
        cfg2, _, params2 = hf_io.load_hf(tmp_path / dtype, param_dtype=dtype)
        assert cfg2 == cfg
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_sharded_index_save_and_load(tmp_path, tokens):
    model = make_checkpoint(tmp_path / "src", "mistral")
    model.save_pretrained(tmp_path / "hf_sharded", safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "hf_sharded" / hf_io.INDEX_FILE).exists()
    cfg, graphdef, params = hf_io.load_hf(tmp_path / "hf_sharded")
    assert_close_f32(our_logits(graphdef, params, tokens), torch_logits(model, tokens))
    hf_io.save_hf(tmp_path / "ours_sharded", cfg, params, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "ours_sharded" / hf_io.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2
    _, _, params2 = hf_io.load_hf(tmp_path / "ours_sharded")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_load_onto_sharding(tmp_path):
    make_checkpoint(tmp_path, "llama_tied")
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    _, _, params = hf_io.load_hf(tmp_path, shardings=sharding)
    assert all(leaf.sharding == sharding for leaf in jax.tree.leaves(params))
