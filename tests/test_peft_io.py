"""PEFT-format adapters (models/peft_io.py) against peft itself on torch CPU, f32.

Our adapters saved with save_peft and loaded by `PeftModel.from_pretrained` onto the base model
give our logits, and so does our merged model exported with save_hf; adapters that peft
creates and saves load with load_peft into our model with peft's logits; save_peft then
load_peft gives back the same arrays; bad directories are refused in one line.

Every weight is random at the scale that keeps activations O(1) (norms near 1, B non-zero),
so the adapters move the logits by O(1) while the two implementations agree to ~1e-6: a
transposed A or B, a wrong scale or a missed target would fail by orders of magnitude.
"""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, hf_io, lora, peft_io, tiny_config
from pipelinerl_jax.models import params as params_lib

ALL = ["q", "k", "v", "o", "gate", "up", "down"]
TOL = 1e-5  # max |diff| of f32 logits of size O(1)
# B at a quarter of the 1 / fan_in scale: the adapters still move the logits by O(1), but at the
# full scale they grew the activations until f32 rounding alone, in torch as in ours, was ~1e-5
# from a float64 reference (7e-6 and 9e-6).
B_SCALE = 0.25


def _random_params(cfg, seed):
    """Every param of cfg's table (adapters included) drawn fresh, at a scale that keeps each
    layer's output O(1): matmul weights N(0, 1 / fan_in) (B: B_SCALE times that), norms
    1 + N(0, 0.1^2), biases N(0, 0.1^2)."""
    rng = np.random.default_rng(seed)
    sizes = params_lib.axis_sizes(cfg)
    out = {"layers": {}}
    for s in decoder.param_specs(cfg):
        value = rng.standard_normal(params_lib.shape_of(s, cfg)).astype(np.float32)
        if "norm" in s.name:
            value = 1.0 + 0.1 * value
        elif s.n_in:
            value /= math.sqrt(math.prod(sizes[a] for a in s.layer_axes[: s.n_in]))
            if s.name.endswith(lora.SUFFIX_B):
                value *= B_SCALE
        elif s.key != "embed":
            value *= 0.1  # biases
        (out["layers"] if s.per_layer else out)[s.name] = value
    return out


def _tokens(cfg, seed):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 11))


def _ours(cfg, params, tokens):
    graphdef, _ = decoder.abstract_init(cfg)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(
        decoder.jit_forward(graphdef, params, jnp.asarray(tokens), jnp.asarray(positions))
    )


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _max_diff(a, b):
    return float(np.abs(a - b).max())


# (family, targets, rank, alpha, tied head): every projection on llama; a subset, a
# non-integer scale (5 / 3) and q/k/v biases on qwen2.
CASES = {
    "llama_all": ("llama", ALL, 4, 8.0, False),
    "qwen2_q_v": ("qwen2", ["q", "v"], 3, 5.0, True),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, targets, rank, alpha, tied = CASES[request.param]
    cfg = tiny_config(
        family,
        tie_word_embeddings=tied,
        lora={"rank": rank, "alpha": alpha, "targets": targets},
    )
    params = _random_params(cfg, seed=len(request.param))
    root = tmp_path_factory.mktemp(request.param)
    # The base rows only (save_hf of a config with adapters would write the merged model).
    hf_io.save_hf(root / "base", dataclasses.replace(cfg, lora=None), params)
    peft_io.save_peft(cfg, params, root / "adapter", base_model_name_or_path=str(root / "base"))
    tokens = _tokens(cfg, seed=7 + len(request.param))
    return dict(cfg=cfg, params=params, root=root, tokens=tokens, ours=_ours(cfg, params, tokens))


def test_peft_runs_our_adapter_as_we_do(case):
    model = peft.PeftModel.from_pretrained(
        _hf_model(case["root"] / "base"), str(case["root"] / "adapter")
    )
    model.eval()
    assert not model.peft_config["default"].use_rslora
    ref = _torch_logits(model, case["tokens"])
    assert _max_diff(case["ours"], ref) <= TOL
    with model.disable_adapter():
        base = _torch_logits(model, case["tokens"])
    assert _max_diff(ref, base) > 0.1  # the adapters matter at this scale


def test_our_merged_export_runs_in_transformers_as_we_do(case):
    cfg = case["cfg"]
    merged = lora.merged_weights(case["params"], cfg.lora)
    hf_io.save_hf(case["root"] / "merged", dataclasses.replace(cfg, lora=None), merged)
    ref = _torch_logits(_hf_model(case["root"] / "merged"), case["tokens"])
    assert _max_diff(case["ours"], ref) <= TOL


def test_save_then_load_gives_back_the_same_arrays(case):
    cfg, adapter_dir = case["cfg"], case["root"] / "adapter"
    assert peft_io.peft_lora_config(adapter_dir) == cfg.lora
    adapters = peft_io.load_peft(adapter_dir, cfg)
    want = lora.split(case["params"])[0]
    assert set(adapters["layers"]) == set(want["layers"])
    for name, value in want["layers"].items():
        assert adapters["layers"][name].dtype == np.float32
        np.testing.assert_array_equal(adapters["layers"][name], value)
    written = json.loads((adapter_dir / peft_io.CONFIG_FILE).read_text())
    assert written["target_modules"] == list(cfg.lora.targets)
    assert (written["r"], written["lora_alpha"]) == (cfg.lora.rank, cfg.lora.alpha)
    assert not [n for n in os.listdir(case["root"]) if n.startswith(".")]  # no temporary left


def test_bfloat16_state_and_adapters_alone_round_trip_exactly(tmp_path):
    cfg = tiny_config(param_dtype="bfloat16", lora={"rank": 2, "alpha": 4, "targets": ["o", "up"]})
    state = decoder.abstract_init(cfg)[1]  # the whole model's nnx.State, random bf16 values
    random = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), _random_params(cfg, seed=3))
    nnx.replace_by_pure_dict(state, random)
    adapters = lora.split(random)[0]
    for params in (state, adapters):
        peft_io.save_peft(cfg, params, tmp_path / "a")
        back = peft_io.load_peft(tmp_path / "a", cfg)
        for name, value in adapters["layers"].items():
            # Loaded adapters are f32 (lora.ADAPTER_DTYPE), exactly the bf16 values saved.
            assert back["layers"][name].dtype == jnp.float32
            np.testing.assert_array_equal(back["layers"][name], np.asarray(value, np.float32))


def test_adapter_made_by_peft_loads_into_our_model(tmp_path):
    base_cfg = tiny_config("llama")
    base = _random_params(base_cfg, seed=11)
    hf_io.save_hf(tmp_path / "base", base_cfg, base)
    # "all-linear" less two: peft saves it as every layer's module names, an exclusion applied.
    config = peft.LoraConfig(
        r=2,
        lora_alpha=7,
        target_modules="all-linear",
        exclude_modules=["q_proj", "mlp.gate_proj"],
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(_hf_model(tmp_path / "base"), config)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # B starts at zero: draw both, O(1) like the base
                scale = B_SCALE if "lora_B" in name else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    model.save_pretrained(tmp_path / "adapter")
    tokens = _tokens(base_cfg, seed=13)
    ref = _torch_logits(model.eval(), tokens)

    saved = json.loads((tmp_path / "adapter" / peft_io.CONFIG_FILE).read_text())
    assert "model.layers.1.mlp.up_proj" in saved["target_modules"]
    found = peft_io.peft_lora_config(tmp_path / "adapter")
    assert found == lora.LoraConfig(2, 7.0, ("k_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    cfg = dataclasses.replace(base_cfg, lora=found)
    adapters = peft_io.load_peft(tmp_path / "adapter", cfg)
    ours = _ours(cfg, lora.merge(adapters, base), tokens)
    assert _max_diff(ours, ref) <= TOL
    with model.disable_adapter():
        assert _max_diff(ref, _torch_logits(model, tokens)) > 0.1  # the adapters matter


@pytest.mark.parametrize(
    "target_modules, exclude, want",
    [
        ("all-linear", None, lora.TARGETS),
        (r".*\.(q|v)_proj", None, ("q_proj", "v_proj")),
        (["self_attn.o_proj", "mlp.up_proj"], None, ("o_proj", "up_proj")),
        (
            ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.k_proj"],
            [],
            ("k_proj", "down_proj"),
        ),
        (r".*_proj", r".*\.mlp\..*", ("q_proj", "k_proj", "v_proj", "o_proj")),
        (
            "all-linear",
            ["down_proj", "gate_proj"],
            ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"),
        ),
    ],
)
def test_target_modules_are_matched_as_peft_matches_them(tmp_path, target_modules, exclude, want):
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": target_modules}
    (tmp_path / peft_io.CONFIG_FILE).write_text(json.dumps({**config, "exclude_modules": exclude}))
    assert peft_io.peft_lora_config(tmp_path) == lora.LoraConfig(4, 16.0, want)


BAD_CFG = tiny_config(lora={"rank": 4, "alpha": 8, "targets": ["q", "v", "down"]})


def _edit_config(**fields):
    def edit(path):
        config = json.loads((path / peft_io.CONFIG_FILE).read_text())
        (path / peft_io.CONFIG_FILE).write_text(json.dumps({**config, **fields}))

    return edit


def _edit_tensors(edit_dict):
    def edit(path):
        tensors = load_file(path / peft_io.WEIGHTS_FILE)
        edit_dict(tensors)
        save_file(tensors, path / peft_io.WEIGHTS_FILE)

    return edit


Q_A = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda p: (p / peft_io.CONFIG_FILE).unlink(), "adapter_config.json: missing"),
        (lambda p: (p / peft_io.WEIGHTS_FILE).unlink(), "adapter_model.safetensors: missing"),
        (lambda p: (p / peft_io.CONFIG_FILE).write_text("{"), "invalid JSON"),
        (_edit_config(r=8), "r=8 but model.lora rank=4"),
        (_edit_config(lora_alpha=16), "lora_alpha=16 but model.lora alpha=8"),
        (_edit_config(target_modules=["q_proj", "v_proj"]), "target_modules ['q_proj', 'v_proj']"),
        (_edit_config(target_modules=["q_proj", "lm_head"]), "'lm_head' is not supported"),
        (_edit_config(target_modules=r".*embed_tokens"), "adapts none of q_proj"),
        (_edit_config(use_rslora=True), "set use_rslora=false and lora_alpha=16"),
        (_edit_config(use_dora=True), "use_dora=True (DoRA) is not supported"),
        (_edit_config(bias="lora_only"), "bias='lora_only' (trained biases) is not supported"),
        (_edit_config(modules_to_save=["lm_head"]), "modules_to_save=['lm_head']"),
        (_edit_config(layers_to_transform=[0]), "(adapters on some layers only) is not"),
        (_edit_config(rank_pattern={"q_proj": 8}), "(per-module ranks) is not supported"),
        (_edit_config(peft_type="IA3"), "peft_type='IA3' is not supported"),
        (_edit_config(task_type="SEQ_CLS"), "task_type='SEQ_CLS' is not supported"),
        (_edit_config(some_new_option=True), "unknown field some_new_option=True"),
        (_edit_tensors(lambda t: t.pop(Q_A)), f"tensor {Q_A!r} not found (1 missing)"),
        (_edit_tensors(lambda t: t.update({Q_A: t[Q_A].T.copy()})), "has shape (32, 4) but r=4"),
        (
            _edit_tensors(lambda t: t.update({"base_model.model.lm_head.lora_A.weight": t[Q_A]})),
            "unexpected tensor 'base_model.model.lm_head.lora_A.weight'",
        ),
    ],
)
def test_bad_adapter_is_refused_in_one_line(tmp_path, edit, words):
    peft_io.save_peft(BAD_CFG, _random_params(BAD_CFG, seed=5), tmp_path / "a")
    edit(tmp_path / "a")
    with pytest.raises(ConfigError) as err:
        peft_io.load_peft(tmp_path / "a", BAD_CFG)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_save_refusals_leave_the_old_directory_whole(tmp_path):
    params = _random_params(BAD_CFG, seed=6)
    peft_io.save_peft(BAD_CFG, params, tmp_path / "a")
    before = (tmp_path / "a" / peft_io.WEIGHTS_FILE).read_bytes()
    no_lora = dataclasses.replace(BAD_CFG, lora=None)
    fewer = dataclasses.replace(BAD_CFG, lora=lora.LoraConfig(4, 8.0, ("q_proj",)))
    other_rank = dataclasses.replace(BAD_CFG, lora=lora.LoraConfig(2, 8.0, BAD_CFG.lora.targets))
    for cfg, words in [
        (no_lora, "no LoRA adapters"),
        (fewer, "params hold adapter 'down_proj_lora_a' but model.lora targets only"),
        (other_rank, "has shape (2, 32, 4) but the model config implies (2, 32, 2)"),
    ]:
        with pytest.raises(ConfigError) as err:
            peft_io.save_peft(cfg, params, tmp_path / "a")
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="params hold no 'layers/q_proj_lora_a'"):
        peft_io.save_peft(BAD_CFG, lora.split(params)[1], tmp_path / "a")
    with pytest.raises(ConfigError, match="the model config has no LoRA adapters"):
        peft_io.load_peft(tmp_path / "a", no_lora)
    assert (tmp_path / "a" / peft_io.WEIGHTS_FILE).read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no temporary directory left behind
    peft_io.save_peft(BAD_CFG, _random_params(BAD_CFG, seed=7), tmp_path / "a")  # replaces
    assert (tmp_path / "a" / peft_io.WEIGHTS_FILE).read_bytes() != before
    assert sorted(os.listdir(tmp_path)) == ["a"]
