"""Hugging Face checkpoint I/O: load a model directory into params, export params back.

Loading reads `config.json` and `model.safetensors` (or the shards listed in
`model.safetensors.index.json`) with safetensors' numpy backend: no torch. Per-layer tensors are
transposed to our input-major layout, stacked along the layer axis, cast to the param dtype and
put on their device (or directly onto their NamedSharding, so no device ever holds a full
copy of a sharded leaf) one leaf at a time. Export writes config.json, generation_config.json,
safetensors shards with an index when needed, and the tokenizer files, into a temporary
directory renamed into place at the end (no partial checkpoints).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import config_json, decoder, lora
from pipelinerl_jax.models import params as params_lib
from pipelinerl_jax.models import tokenizer as tok_lib
from pipelinerl_jax.models.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# Buffers some exporters leave in checkpoints; recomputed here, safe to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _tensor_specs(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(our key, HF name with {i} for the layer, our per-layer shape, n_in) for every tensor of
    the family's table (models/params.py)."""
    return [
        (s.key, s.hf, params_lib.shape_of(s, cfg, per_layer=True), s.n_in)
        for s in decoder.base_param_specs(cfg)
    ]


def hf_shape(key: str, shape: tuple[int, ...], n_in: int) -> tuple[int, ...]:
    """Shape of the HF tensor: linear weights [out, in], biases flat [H*D], others as ours."""
    if n_in:
        return (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))
    if key.endswith("_bias"):
        return (int(np.prod(shape)),)
    return shape


def to_ours(hf: np.ndarray, shape: tuple[int, ...], n_in: int) -> np.ndarray:
    """HF [out, in] -> ours (in dims..., out dims...); a view where no copy is needed."""
    return hf.T.reshape(shape) if n_in else hf.reshape(shape)


def to_hf(ours: np.ndarray, hf_shape_: tuple[int, ...], n_in: int) -> np.ndarray:
    """Ours -> HF layout, contiguous (safetensors writes raw bytes)."""
    if n_in:
        return np.ascontiguousarray(ours.reshape(hf_shape_[1], hf_shape_[0]).T)
    return np.ascontiguousarray(ours.reshape(hf_shape_))


class _Reader:
    """Looks up tensors by name across one file or an index of shards (files opened lazily)."""

    def __init__(self, model_dir: Path):
        index = model_dir / INDEX_FILE
        single = model_dir / SINGLE_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ConfigError(
                    f"{index}: not a valid safetensors index ({e}); re-export the model"
                ) from None
            self.where = {name: model_dir / fname for name, fname in weight_map.items()}
            for path in sorted(set(self.where.values())):
                if not path.exists():
                    raise ConfigError(
                        f"{path}: shard listed in {INDEX_FILE} is missing; copy it or re-download"
                    )
        elif single.exists():
            self.where = None
            self.single = single
        else:
            found = sorted(p.name for p in model_dir.glob("*.bin")) or sorted(
                p.name for p in model_dir.iterdir()
            )
            raise ConfigError(
                f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (found {found[:5]}); "
                "save the model with save_pretrained(..., safe_serialization=True)"
            )
        self._handles: dict[Path, object] = {}

    def _handle(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for corrupt files.
                raise ConfigError(
                    f"{path}: cannot read safetensors file ({e}); re-export it"
                ) from None
        return self._handles[path]

    def names(self) -> set[str]:
        if self.where is not None:
            return set(self.where)
        return set(self._handle(self.single).keys())

    def path_of(self, name: str) -> Path:
        return self.single if self.where is None else self.where[name]

    def get(self, name: str, expected: tuple[int, ...]) -> np.ndarray:
        path = self.path_of(name)
        handle = self._handle(path)
        shape = tuple(handle.get_slice(name).get_shape())
        if shape != tuple(expected):
            raise ConfigError(
                f"{path.name}: tensor {name!r} has shape {shape} but config.json implies "
                f"{tuple(expected)}; the weights do not match config.json"
            )
        return handle.get_tensor(name)


def read_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"{model_dir}: model directory does not exist")
    if not path.exists():
        raise ConfigError(f"{path}: missing; a Hugging Face model directory needs config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None


def _leaf_shardings(shardings, keys: list[str]) -> dict:
    if shardings is None:
        return {}
    if isinstance(shardings, jax.sharding.Sharding):
        return {key: shardings for key in keys}
    pure = nnx.to_pure_dict(shardings) if isinstance(shardings, nnx.State) else shardings
    out = {}
    for key in keys:
        node = pure
        for part in key.split("/"):
            node = node[part]
        out[key] = node.get_value() if isinstance(node, nnx.Variable) else node
    return out


def load_hf(
    model_dir: str | os.PathLike,
    *,
    param_dtype: str = "float32",
    compute_dtype: str | None = None,
    shardings=None,
    remat: bool = False,
    remat_policy: str = "attention",
    config_overrides: dict | None = None,
    check_tokenizer: bool = True,
    rng: jax.Array | None = None,
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """Loads a Hugging Face Llama/Qwen2/Qwen3/Mistral directory -> (cfg, graphdef, params).

    `shardings`: None (default device), one Sharding for every leaf, or the pytree from
    `pipelinerl_jax.sharding.param_shardings`; each leaf goes straight onto its sharding.
    With `config_overrides={"lora": {...}}` the params also hold fresh LoRA adapters (A drawn
    from `rng`, default key 0; B zero), so the loaded model is still exactly the checkpoint's.
    """
    model_dir = Path(model_dir)
    hf_config = read_config(model_dir)
    cfg = config_json.from_hf(
        hf_config,
        param_dtype=param_dtype,
        compute_dtype=compute_dtype or param_dtype,
        remat=remat,
        remat_policy=remat_policy,
        **(config_overrides or {}),
    )
    if check_tokenizer and (model_dir / "tokenizer.json").exists():
        tok_lib.check_vocab(tok_lib.Tokenizer.from_dir(model_dir), cfg)
    reader = _Reader(model_dir)
    specs = _tensor_specs(cfg)
    expected_names = {name.format(i=i) for _, name, _, _ in specs for i in range(cfg.num_layers)}
    present = reader.names()
    missing = sorted(expected_names - present)
    if missing:
        raise ConfigError(
            f"{model_dir}: tensor {missing[0]!r} not found ({len(missing)} missing); the checkpoint "
            f"is incomplete or its model_type {cfg.model_type!r} / tie_word_embeddings is wrong"
        )
    allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(
        n for n in present - expected_names - allowed_extra if not n.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise ConfigError(
            f"{reader.path_of(unexpected[0]).name}: unexpected tensor {unexpected[0]!r} "
            f"({len(unexpected)} in all) for model_type {cfg.model_type!r}; this architecture "
            "variant is not supported"
        )

    dtype = _NP_DTYPES[param_dtype]
    keys = [s.key for s in decoder.param_specs(cfg)]  # the adapters' too
    target = _leaf_shardings(shardings, keys)
    loaded: dict = {"layers": {}}
    for key, name, shape, n_in in specs:
        expected = hf_shape(key, shape, n_in)
        if key.startswith("layers/"):
            host = np.empty((cfg.num_layers, *shape), dtype)
            for i in range(cfg.num_layers):
                host[i] = to_ours(reader.get(name.format(i=i), expected), shape, n_in)
        else:
            host = np.asarray(to_ours(reader.get(name, expected), shape, n_in), dtype)
        leaf = jax.device_put(host, target[key]) if key in target else jax.numpy.asarray(host)
        node = loaded
        *parents, last = key.split("/")
        for part in parents:
            node = node[part]
        node[last] = leaf
        del host
    if cfg.lora is not None:
        rng = jax.random.key(0) if rng is None else rng
        adapters = decoder.init_adapters(cfg, rng)["layers"]
        for key, value in adapters.items():
            where = target.get(f"layers/{key}")
            loaded["layers"][key] = value if where is None else jax.device_put(value, where)
    graphdef, params = decoder.abstract_init(cfg)
    nnx.replace_by_pure_dict(params, loaded)
    return cfg, graphdef, params


def hf_tensors(cfg: ModelConfig, params) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, numpy array in HF layout) for every tensor, in checkpoint order. LoRA
    adapters (cfg.lora) are folded into their weights: the checkpoint is the merged model."""
    pure = decoder.arrays(params)
    if cfg.lora is not None:
        pure = lora.merged_weights(pure, cfg.lora)
    for key, name, shape, n_in in _tensor_specs(cfg):
        expected = hf_shape(key, shape, n_in)
        node = pure
        for part in key.split("/"):
            node = node[part]
        host = np.asarray(jax.device_get(node))
        if key.startswith("layers/"):
            for i in range(cfg.num_layers):
                yield name.format(i=i), to_hf(host[i], expected, n_in)
        else:
            yield name, to_hf(host, expected, n_in)


def _shards(tensors, max_shard_bytes: int) -> list[dict[str, np.ndarray]]:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors:
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    return shards


def generation_config(cfg: ModelConfig, pad_token_id: int | None = None) -> dict:
    out = {"_from_model_config": True}
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        eos = cfg.eos_token_id
        out["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
    if pad_token_id is not None:
        out["pad_token_id"] = pad_token_id
    return out


def save_hf(
    model_dir: str | os.PathLike,
    cfg: ModelConfig,
    params,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 4 * 2**30,
) -> None:
    """Writes a Hugging Face directory (config, generation config, weights, tokenizer files).

    Weights keep the param dtype. The directory is assembled under a temporary name and renamed
    into place, replacing an existing `model_dir` only once everything is written.
    """
    model_dir = Path(model_dir)
    check_replaceable(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
    try:
        shards = _shards(hf_tensors(cfg, params), max_shard_bytes)
        metadata = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE_FILE), metadata=metadata)
        else:
            weight_map, total = {}, 0
            for n, shard in enumerate(shards, start=1):
                fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata=metadata)
                for name, array in shard.items():
                    weight_map[name] = fname
                    total += array.nbytes
            (tmp / INDEX_FILE).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        del shards
        (tmp / "config.json").write_text(json.dumps(config_json.to_hf(cfg), indent=2))
        gen_src = Path(tokenizer_dir) / "generation_config.json" if tokenizer_dir else None
        if gen_src is not None and gen_src.exists():
            shutil.copyfile(gen_src, tmp / "generation_config.json")
        else:
            (tmp / "generation_config.json").write_text(
                json.dumps(generation_config(cfg), indent=2)
            )
        if tokenizer_dir is not None:
            tokenizer_dir = Path(tokenizer_dir)
            if not (tokenizer_dir / "tokenizer.json").exists():
                raise ConfigError(
                    f"{tokenizer_dir}: no tokenizer.json to copy; pass the model's own directory"
                )
            for fname in TOKENIZER_FILES:
                if (tokenizer_dir / fname).exists():
                    shutil.copyfile(tokenizer_dir / fname, tmp / fname)
        replace_dir(tmp, model_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


# What the model and adapter writers (save_hf, gguf_io.convert, peft_io.save_peft) put in a
# directory: an existing directory holding only these is an earlier export, which a new one
# replaces whole. Anything else in it is the user's and must not be deleted with it.
EXPORT_FILES = frozenset(
    {
        *(SINGLE_FILE, INDEX_FILE, "config.json", "generation_config.json", *TOKENIZER_FILES),
        *("adapter_config.json", "adapter_model.safetensors"),  # peft_io's
        "gguf_source.json",  # gguf_io's
    }
)
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def check_replaceable(out: str | os.PathLike, also: tuple[str, ...] = ()) -> None:
    """A one-line ConfigError unless writing a model directory at `out` can lose nothing but an
    earlier export: `out` is absent, an empty directory, or one holding only the files the
    writers make (EXPORT_FILES, shards, `also`), and at most subdirectories of the same kind
    (an export's adapter/). Called before the work, and again just before the swap."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"{out}: exists and is not a directory; name a directory to write")
    foreign = _foreign_entries(out, frozenset(also))
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ConfigError(
            f"{out}: exists and holds {foreign[0]!r}{more}, which no model export writes; an "
            "export replaces its directory whole, so name a new directory (or an earlier "
            "export's)"
        )


def _foreign_entries(folder: Path, also: frozenset[str], depth: int = 1) -> list[str]:
    out = []
    for path in sorted(folder.iterdir()):
        if path.is_dir() and not path.is_symlink() and depth > 0:
            out += [f"{path.name}/{n}" for n in _foreign_entries(path, also, depth - 1)]
        elif not (
            path.is_file()
            and (path.name in EXPORT_FILES or path.name in also or _SHARD_FILE.fullmatch(path.name))
        ):
            out.append(path.name)
    return out


def replace_dir(tmp: Path, out: Path) -> None:
    """Moves a finished directory `tmp` to `out`; an existing `out` is replaced only at this
    point, so a failure before it leaves the old directory whole. An `out` holding anything an
    export does not write is refused (check_replaceable), never deleted."""
    check_replaceable(out, also=tuple(p.name for p in tmp.iterdir()))
    for path in tmp.iterdir():
        os.chmod(path, 0o644)  # safetensors and mkdtemp create owner-only files
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    os.chmod(out, 0o755)
