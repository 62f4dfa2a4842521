"""Import a llama.cpp GGUF file as a Hugging Face model directory (the one `hf_io.load_hf` reads).

    from pipelinerl_jax.models import gguf_io
    gguf_io.convert("model.Q4_1.gguf", "models/model", dtype="float32")

The file is read with the `gguf` library; every weight is dequantized to f32 with
`gguf.quants.dequantize` and written to safetensors in HF layout ([out, in]) in the chosen
dtype. Architecture: `llama` (Llama 2/3, SmolLM2, ...). llama.cpp's converter interleaves the two
rotary halves of each q/k head (its `permute`); `unpermute_qk` undoes that exactly.

The tokenizer is rebuilt from the GGUF vocabulary and merges as a `tokenizers` byte-level BPE
(llama.cpp tokenizer model "gpt2"), with the pre-tokenizer llama.cpp uses for the file's
`tokenizer.ggml.pre`, control tokens as special tokens and user-defined ones as added tokens.
config.json, generation_config.json, tokenizer.json and tokenizer_config.json (with the chat
template) are written next to the weights, all into a temporary directory renamed into place
at the end (an existing output directory is replaced only once everything is written, as
`hf_io.save_hf` does). Bad input raises a one-line `ConfigError`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import config_json, hf_io, param_counts, rope
from pipelinerl_jax.models.config import ModelConfig

SUPPORTED_ARCHS = ("llama",)
# Types whose dequantization is exercised by tests/test_gguf_io.py against transformers.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
SUPPORTED_TOKENIZERS = ("gpt2",)
SOURCE_FILE = "gguf_source.json"  # records which GGUF the directory was converted from

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp stores Llama 3.1+ rope scaling as per-frequency divisors, not as metadata.
_ROPE_FREQS = "rope_freqs.weight"
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

# Split regexes of llama.cpp's pre-tokenizer types (the byte-level step then runs without its
# own regex). None: GPT-2's regex, i.e. `ByteLevel(use_regex=True)`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    "default": None,
    "gpt2": None,
    "gpt-2": None,
    "smollm": "digits",  # GPT-2's regex after splitting every digit off (llama.cpp's SMOLLM)
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType values


# --- reading ---------------------------------------------------------------------------------


def open_gguf(path: str | os.PathLike):
    """(GGUFReader, metadata dict). Missing, non-GGUF or truncated files -> one-line ConfigError."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--gguf={path}: file does not exist; check the path")
    try:
        reader = gguf.GGUFReader(path)
        meta = {key: field.contents() for key, field in reader.fields.items()}
    except Exception as e:  # the reader raises ValueError, IndexError, ... on damaged files.
        raise ConfigError(
            f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); the file "
            "is truncated or not GGUF, download it again"
        ) from None
    return reader, meta


def _check_supported(path: Path, reader, meta: dict) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ConfigError(
                f"{path.name}: tensor {t.name!r} has type {t.tensor_type.name}, which is not "
                f"supported; supported: {', '.join(SUPPORTED_TYPES)} (use a file quantized "
                "to one of these, e.g. Q8_0 or Q4_1)"
            )
    return arch


def _llama3_rope_scaling(factors_P: np.ndarray, head_dim: int, theta: float) -> dict:
    """Llama 3 rope_scaling whose per-frequency divisors equal llama.cpp's rope_freqs tensor.

    The tensor only holds the divisors; factor is their maximum and the remaining parameters are
    the ones every Llama 3.x release uses, accepted only if they reproduce the tensor.
    """

    scaling = {
        "rope_type": "llama3",
        "factor": float(factors_P.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain_P = rope.inv_frequencies(head_dim, theta, None)
    scaled_P = rope.inv_frequencies(head_dim, theta, scaling)
    matches = factors_P.shape == plain_P.shape and np.allclose(
        plain_P / scaled_P, factors_P, rtol=1e-4
    )
    if not matches:
        raise ConfigError(
            f"{_ROPE_FREQS}: rope frequency factors that are not Llama 3 rope "
            f"scaling ({scaling}) are not supported"
        )
    return scaling


def hf_config(meta: dict, reader, *, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(ModelConfig, config.json dict) from the GGUF metadata of a llama-architecture file."""
    import gguf

    a = meta["general.architecture"]
    names = {t.name for t in reader.tensors}
    try:
        hidden, heads = int(meta[f"{a}.embedding_length"]), int(meta[f"{a}.attention.head_count"])
        embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
        config = {
            "model_type": "llama",
            # The embedding's rows are the truth; vocab_size metadata is optional in GGUF.
            "vocab_size": int(embed.shape[-1]),
            "hidden_size": hidden,
            "intermediate_size": int(meta[f"{a}.feed_forward_length"]),
            "num_hidden_layers": int(meta[f"{a}.block_count"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(meta.get(f"{a}.attention.key_length", hidden // heads)),
            "rms_norm_eps": float(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
            "rope_theta": float(meta.get(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(meta[f"{a}.context_length"]),
            # llama.cpp writes output.weight only when the head is not the embedding.
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        }
    except (KeyError, StopIteration) as e:
        raise ConfigError(
            f"GGUF metadata: missing {e.args[0] if e.args else 'token_embd.weight'!r}"
            "; the file is not a complete llama model"
        ) from None
    rotary = meta.get(f"{a}.rope.dimension_count", config["head_dim"])
    if rotary != config["head_dim"]:
        raise ConfigError(
            f"GGUF metadata: {a}.rope.dimension_count={rotary} != head_dim="
            f"{config['head_dim']}; partial rotary embeddings are not supported"
        )
    scaling_type = meta.get(f"{a}.rope.scaling.type", "none")
    if scaling_type == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(meta[f"{a}.rope.scaling.factor"]),
        }
    elif scaling_type != "none":
        raise ConfigError(
            f"GGUF metadata: {a}.rope.scaling.type={scaling_type!r} is not "
            "supported; supported: none, linear, llama3 (rope_freqs tensor)"
        )
    if _ROPE_FREQS in names:
        tensor = next(t for t in reader.tensors if t.name == _ROPE_FREQS)
        factors_P = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        config["rope_scaling"] = _llama3_rope_scaling(
            factors_P, config["head_dim"], config["rope_theta"]
        )
    cfg = config_json.from_hf(config, param_dtype=dtype, compute_dtype=dtype)
    out = config_json.to_hf(cfg)
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        out["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    return cfg, out


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name for a GGUF one (None if the llama layout has no such tensor)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        if parts[2] in _LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def unpermute_qk(w_OxI: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverts llama.cpp's q/k row permutation (O = num_heads * head_dim rows).

    HF orders each head's rows (half, i) (rotate_half pairs row i with row i + D/2); llama.cpp
    reorders them to (i, half) so that pairs are adjacent. Reading the rows back as
    (head, i, half) and swapping the last two axes restores (head, half, i).
    """
    out_dim, in_dim = w_OxI.shape
    d_half = out_dim // num_heads // 2
    return w_OxI.reshape(num_heads, d_half, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def hf_tensors(reader, cfg: ModelConfig) -> Iterator[tuple[str, object]]:
    """(HF name, GGUF tensor) in file order; refuses tensors the llama layout does not have."""
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue  # became config.json's rope_scaling
        name = hf_name(t.name)
        if name is None:
            raise ConfigError(
                f"GGUF tensor {t.name!r} has no place in a {cfg.model_type} model "
                "(MoE, biases and other variants are not supported)"
            )
        yield name, t


def dequantize(tensor, cfg: ModelConfig) -> np.ndarray:
    """The tensor as f32 in HF layout ([out, in] for weights), q/k rows un-permuted."""
    import gguf

    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims fastest first
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    if tensor.name.endswith(".attn_q.weight"):
        array = unpermute_qk(array, cfg.num_heads)
    elif tensor.name.endswith(".attn_k.weight"):
        array = unpermute_qk(array, cfg.num_kv_heads)
    return np.asarray(array, np.float32)


# --- tokenizer -------------------------------------------------------------------------------


def build_tokenizer(meta: dict):
    """(tokenizers.Tokenizer, tokenizer_config dict) from the GGUF vocabulary and merges."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZERS:
        raise ConfigError(
            f"GGUF tokenizer.ggml.model={kind!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_TOKENIZERS)} (byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ConfigError(
            f"GGUF tokenizer.ggml.pre={pre!r} is not supported; supported: "
            f"{', '.join(_PRE_TOKENIZERS)}"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a repeated string keeps its first id
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as e:  # tokenizers raises a bare Exception on inconsistent merges.
        raise ConfigError(
            f"GGUF tokenizer: vocabulary and merges do not form a BPE ({e})"
        ) from None
    split = _PRE_TOKENIZERS[pre]
    # GPT-2's regex inside ByteLevel, unless a Split in front already does the splitting.
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=split in (None, "digits")
    )
    if split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # Control tokens stay whole and are special; user-defined ones stay whole, not special.
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types)
            if k == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types)
            if k == _USER_DEFINED
        ]
    )

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        first = [bos] if add_bos else []
        last = [eos] if add_eos else []
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(first + ["$A"] + last),
            pair=" ".join(
                first
                + ["$A"]
                + last
                + [f"{t}:1" for t in first]
                + ["$B:1"]
                + [f"{t}:1" for t in last]
            ),
            special_tokens=[(t, vocab[t]) for t in dict.fromkeys(first + last)],
        )
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    tok_config = {k: v for k, v in tok_config.items() if v is not None}
    if meta.get("tokenizer.chat_template") is not None:
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, tok_config


# --- writing ---------------------------------------------------------------------------------


def _shard_plan(named, dtype: np.dtype, max_shard_bytes: int) -> list[list[tuple[str, object]]]:
    """Groups (HF name, GGUF tensor) into shards of at most max_shard_bytes (output dtype)."""
    shards: list[list] = [[]]
    size = 0
    for name, t in named:
        nbytes = int(np.prod([int(n) for n in t.shape])) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    return shards


def _check_layout(named: list[tuple[str, object]], cfg: ModelConfig) -> None:
    """Every tensor the llama layout needs is present exactly once, with the expected shape."""
    expected = {}
    for key, name, shape, n_in in hf_io._tensor_specs(cfg):
        for i in range(cfg.num_layers if key.startswith("layers/") else 1):
            expected[name.format(i=i)] = hf_io.hf_shape(key, shape, n_in)
    present = {name: tuple(int(n) for n in reversed(t.shape)) for name, t in named}
    missing = sorted(set(expected) - set(present))
    if missing:
        raise ConfigError(
            f"GGUF file: no tensor for {missing[0]!r} ({len(missing)} missing); "
            "the file is incomplete"
        )
    for name, shape in present.items():
        if name not in expected:
            raise ConfigError(f"GGUF file: unexpected tensor for {name!r}; not a llama layout")
        if shape != expected[name]:
            raise ConfigError(
                f"GGUF file: tensor for {name!r} has shape {shape}, but the "
                f"metadata implies {expected[name]}; the file is inconsistent"
            )


def convert(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = 4 * 2**30,
) -> dict:
    """Writes the GGUF model as a Hugging Face directory at `out_dir`; returns what it did."""
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in _NP_DTYPES:
        raise ConfigError(f"--dtype={dtype}: not supported; use one of {', '.join(_NP_DTYPES)}")
    hf_io.check_replaceable(out_dir)  # before the conversion's work
    reader, meta = open_gguf(gguf_path)
    arch = _check_supported(gguf_path, reader, meta)
    cfg, config = hf_config(meta, reader, dtype=dtype)
    tokenizer, tok_config = build_tokenizer(meta)
    named = list(hf_tensors(reader, cfg))
    _check_layout(named, cfg)
    np_dtype = _NP_DTYPES[dtype]

    try:  # the whole directory is written beside out_dir, then renamed into place
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as e:
        raise ConfigError(
            f"--out={out_dir}: cannot write there ({e.strerror or e}); pick a writable folder"
        ) from None
    try:
        shards = _shard_plan(named, np_dtype, max_shard_bytes)
        weight_map, total = {}, 0
        for n, shard in enumerate(shards, start=1):
            fname = (
                hf_io.SINGLE_FILE
                if len(shards) == 1
                else f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            )
            arrays = {name: dequantize(t, cfg).astype(np_dtype) for name, t in shard}
            save_file(arrays, str(tmp / fname), metadata={"format": "pt"})
            for name, array in arrays.items():
                weight_map[name] = fname
                total += array.nbytes
            del arrays
        if len(shards) > 1:
            (tmp / hf_io.INDEX_FILE).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        gen = hf_io.generation_config(cfg, config.get("pad_token_id"))
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        tokenizer.save(str(tmp / "tokenizer.json"))
        tok_config["model_max_length"] = cfg.max_position_embeddings
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        source = {
            "gguf": gguf_path.name,
            "bytes": gguf_path.stat().st_size,
            "dtype": dtype,
            "architecture": arch,
        }
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2))
        hf_io.replace_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    types = sorted({t.tensor_type.name for t in reader.tensors})
    return {
        "out": str(out_dir),
        "model_type": cfg.model_type,
        "params": param_counts.num_params(cfg),
        "dtype": dtype,
        "gguf_types": types,
        "name": meta.get("general.name"),
    }
