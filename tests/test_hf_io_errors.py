"""Bad checkpoints and configs give one-line ConfigErrors naming the file/tensor and the fix.

Checkpoints here are written by our own save_hf from a random init (no torch needed), then
broken in one way each.
"""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, hf_io
from tests.tiny_models import model_config

CFG = model_config(
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    num_kv_heads=1,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
)


@pytest.fixture
def ckpt(tmp_path):
    _, params = decoder.init(CFG, jax.random.key(0))
    hf_io.save_hf(tmp_path / "m", CFG, params)
    return tmp_path / "m"


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def load_error(path, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        hf_io.load_hf(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_good_checkpoint_loads(ckpt):
    cfg, _, params = hf_io.load_hf(ckpt)
    assert cfg == CFG


def test_missing_directory_and_config(tmp_path):
    assert "does not exist" in load_error(tmp_path / "nope")
    assert "config.json: missing" in load_error(tmp_path)


def test_missing_weights(ckpt):
    (ckpt / hf_io.SINGLE_FILE).rename(ckpt / "pytorch_model.bin")
    message = load_error(ckpt)
    assert "no model.safetensors" in message and "safe_serialization=True" in message


def test_unknown_model_type(ckpt):
    edit_config(ckpt, model_type="gpt2")
    assert "model_type 'gpt2' is not supported" in load_error(ckpt)


def test_shape_mismatch(ckpt):
    edit_config(ckpt, intermediate_size=48)
    message = load_error(ckpt)
    assert "model.safetensors" in message and "mlp.gate_proj.weight" in message
    assert "(32, 16)" in message and "(48, 16)" in message


def test_missing_and_unexpected_tensor(ckpt):
    path = ckpt / hf_io.SINGLE_FILE
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.up_proj.weight"
    up = tensors.pop(name)
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert f"tensor {name!r} not found" in load_error(ckpt)
    tensors[name] = up
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(16, np.float32)
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert "unexpected tensor 'model.layers.0.self_attn.o_proj.bias'" in load_error(ckpt)


def test_missing_shard(tmp_path):
    _, params = decoder.init(CFG, jax.random.key(0))
    hf_io.save_hf(tmp_path / "m", CFG, params, max_shard_bytes=4096)
    index = json.loads((tmp_path / "m" / hf_io.INDEX_FILE).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "m" / shard).unlink()
    assert f"{shard}: shard listed" in load_error(tmp_path / "m")


def test_tokenizer_larger_than_embedding(ckpt):
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(CFG.vocab_size + 5)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(ckpt / "tokenizer.json"))
    message = load_error(ckpt)
    assert "tokenizer.json" in message and "69 token ids" in message and "64 rows" in message


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type(ckpt, rope_type):
    edit_config(ckpt, rope_scaling={"rope_type": rope_type, "factor": 4.0}, rope_parameters=None)
    assert f"rope_scaling type {rope_type!r} is not supported" in load_error(ckpt)


def test_rope_parameters_form_is_read(ckpt):
    edit_config(
        ckpt,
        rope_scaling=None,
        rope_theta=None,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
    )
    cfg, _, _ = hf_io.load_hf(ckpt)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}


def test_sliding_window_refused_unless_context_capped(ckpt):
    edit_config(ckpt, model_type="mistral", sliding_window=32)
    assert "sliding_window=32 < max_position_embeddings=128" in load_error(ckpt)
    cfg, _, _ = hf_io.load_hf(ckpt, config_overrides={"max_position_embeddings": 32})
    assert cfg.max_position_embeddings == 32


def test_unsupported_variants(ckpt):
    edit_config(ckpt, hidden_act="gelu")
    assert "hidden_act='gelu'" in load_error(ckpt)
    edit_config(ckpt, hidden_act="silu", attention_bias=True)
    assert "attention_bias=true" in load_error(ckpt)
    edit_config(ckpt, attention_bias=False, num_hidden_layers=None)
    assert "missing key 'num_hidden_layers'" in load_error(ckpt)
    edit_config(ckpt, num_hidden_layers=2)
    with pytest.raises(ConfigError, match="param_dtype='float16'"):
        hf_io.load_hf(ckpt, param_dtype="float16")
