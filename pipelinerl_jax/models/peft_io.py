"""LoRA adapters in PEFT's format: a directory of `adapter_config.json` and
`adapter_model.safetensors`, as `PeftModel.save_pretrained` writes and `from_pretrained` reads.

PEFT stores, for each adapted Linear of each layer, lora_A [J, I] and lora_B [O, J] (torch's
[out, in]) under the module's name inside its wrapper ("base_model.model." + the transformers
name): "base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight". Our adapter rows
(models/lora.py, models/params.py) are the same matrices input-major and stacked over layers,
A [L, I..., J] and B [L, J, O...], so each tensor converts as hf_io converts a base weight,
with the adapter row's own n_in. The scale is alpha / r on both sides.

Only plain LoRA on some of the seven projections, in every layer, loads: an option that changes
what the adapter computes (rsLoRA, DoRA, biases, per-module ranks, other modules, some layers
only) is refused in one line, because the model we would run would not be the one PEFT runs.

Letters (see pipelinerl_jax/__init__.py): L layers, J LoRA rank, I input features, O output
features.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, hf_io, lora
from pipelinerl_jax.models import params as params_lib
from pipelinerl_jax.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PeftModel.base_model (the LoraModel) .model (the transformers model): the prefix PEFT puts
# before the transformers tensor names the param table holds.
PREFIX = "base_model.model."
_ALL = ", ".join(lora.TARGETS)

# A layer's index in a module or tensor name: "model.layers.3.mlp.up_proj" -> 3.
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _module(target: str, i: int) -> str:
    """The transformers module name of `target` in layer i, in the Llama-style checkpoints all
    our families share (models/params.py): what PEFT matches target_modules against."""
    block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{i}.{block}.{target}"


# Options that change what a loaded adapter computes, each refused when set (truthy).
_UNSUPPORTED = {
    "use_rslora": "rsLoRA",
    "use_dora": "DoRA",
    "lora_bias": "a bias on lora_B",
    "fan_in_fan_out": "Conv1D (GPT-2 style) weights",
    "modules_to_save": "fully trained modules beside the adapters",
    "layers_to_transform": "adapters on some layers only",
    "layer_replication": "replicated layers",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "target_parameters": "adapters on parameters (MoE experts)",
    "trainable_token_indices": "trainable token embeddings",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
    "megatron_config": "Megatron layers",
}
# Fields that leave the loaded adapter's math alone: checked on their own below (peft_type,
# task_type, r, lora_alpha, target_modules, exclude_modules, bias), metadata, training-only
# settings (dropout; VeLoRA swaps only the backward), init recipes (the saved tensors are what
# they made), and settings read only beside a refused option.
_KNOWN = {
    "peft_type",
    "task_type",
    "r",
    "lora_alpha",
    "target_modules",
    "exclude_modules",
    "bias",
    "auto_mapping",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "peft_version",
    "lora_dropout",
    "velora_config",
    "init_lora_weights",
    "loftq_config",
    "eva_config",
    "corda_config",
    "lora_ga_config",
    "layers_pattern",
    "megatron_core",
    "qalora_group_size",
    "ensure_weight_tying",
}


def adapter_config(lora_cfg: lora.LoraConfig, base_model_name_or_path: str | None = None) -> dict:
    """The adapter_config.json of our adapters: plain LoRA, every option that would change the
    math written out at its off value (PEFT fills any field left out with its default)."""
    alpha = lora_cfg.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora_cfg.rank,
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "target_modules": list(lora_cfg.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }


def _adapter_specs(cfg: ModelConfig) -> list[params_lib.ParamSpec]:
    return [s for s in decoder.param_specs(cfg) if lora.is_adapter(s.key)]


def save_peft(
    cfg: ModelConfig,
    params,
    out_dir: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
) -> None:
    """Writes the adapters of `params` (the whole model's nnx.State or dict, or lora.split's
    adapters alone) as a PEFT LoRA directory, in the params' dtype. Assembled under a temporary
    name and renamed into place, so an existing `out_dir` is replaced only when all is written."""
    if cfg.lora is None:
        raise ConfigError("save_peft: the model config has no LoRA adapters (model.lora unset)")
    layers = lora.split(decoder.arrays(params))[0]["layers"]
    specs = _adapter_specs(cfg)
    extra = sorted(set(layers) - {s.name for s in specs})
    if extra:
        raise ConfigError(
            f"save_peft: params hold adapter {extra[0]!r} but model.lora targets only "
            f"{list(cfg.lora.targets)}; pass the config the params were built with"
        )
    tensors = {}
    for s in specs:
        if s.name not in layers:
            raise ConfigError(
                f"save_peft: params hold no {s.key!r}; pass the model's params or the adapters "
                "of lora.split(params), built with this config"
            )
        host_Lx = np.asarray(jax.device_get(layers[s.name]))
        shape = params_lib.shape_of(s, cfg)
        if host_Lx.shape != shape:
            raise ConfigError(
                f"save_peft: {s.key!r} has shape {host_Lx.shape} but the model config implies "
                f"{shape}; pass the config the params were built with"
            )
        hf_shape = hf_io.hf_shape(s.key, shape[1:], s.n_in)
        for i in range(cfg.num_layers):
            tensors[PREFIX + s.hf.format(i=i)] = hf_io.to_hf(host_Lx[i], hf_shape, s.n_in)
    out_dir = Path(out_dir)
    hf_io.check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        config = adapter_config(cfg.lora, base_model_name_or_path)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        hf_io.replace_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _read_config(adapter_dir: Path) -> dict:
    path = adapter_dir / CONFIG_FILE
    if not adapter_dir.is_dir():
        raise ConfigError(f"{adapter_dir}: adapter directory does not exist")
    if not path.exists():
        raise ConfigError(
            f"{path}: missing; a PEFT adapter directory needs it (PeftModel.save_pretrained)"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object; re-save the adapter")
    return config


def _matches(pattern, name: str) -> bool:
    """PEFT's module matching: a string is a regex for the whole name, a list entry the name or
    a dotted suffix of it."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, name) is not None
    return any(name == p or name.endswith(f".{p}") for p in pattern)


def _num_layers(adapter_dir: Path) -> int:
    """1 + the highest layer index among the adapter's tensor names (1 without a readable file:
    load_peft reports that)."""
    try:
        names = safe_open(str(adapter_dir / WEIGHTS_FILE), framework="numpy").keys()
    except Exception:  # a missing or corrupt file: load_peft says which, in one line.
        return 1
    return 1 + max((int(m.group(1)) for n in names if (m := _LAYER.search(n))), default=0)


def _targets(config: dict, path: Path, num_layers: int) -> tuple[str, ...]:
    """The projections that target_modules, less exclude_modules, adapts in any of the layers,
    in lora.TARGETS order (load_peft checks that every layer has them)."""
    wanted, exclude = config.get("target_modules"), config.get("exclude_modules") or []
    for field, value in (("target_modules", wanted), ("exclude_modules", exclude)):
        if isinstance(value, str) and value != "all-linear":
            try:
                re.compile(value)
            except re.error as e:
                raise ConfigError(f"{path}: {field} regex {value!r} is invalid ({e})") from None
        elif not isinstance(value, (str, list)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: {field}={value!r}: give a list of module names")
    if isinstance(wanted, list):
        # PEFT saves "all-linear" expanded into every layer's module names: match each entry
        # by its last name, then in the layers present.
        for entry in wanted:
            if entry.rsplit(".", 1)[-1] not in lora.TARGETS:
                raise ConfigError(
                    f"{path}: target_modules entry {entry!r} is not supported; adapters go on "
                    f"{_ALL} only"
                )
    modules = [(t, _module(t, i)) for i in range(num_layers) for t in lora.TARGETS]
    picked = {
        t
        for t, m in modules
        if (wanted == "all-linear" or _matches(wanted, m)) and not _matches(exclude, m)
    }
    if not picked:
        raise ConfigError(
            f"{path}: target_modules {wanted!r} (less exclude_modules) adapts none of {_ALL}; "
            "only those are supported"
        )
    return tuple(t for t in lora.TARGETS if t in picked)


def peft_lora_config(adapter_dir: str | os.PathLike) -> lora.LoraConfig:
    """The LoraConfig of a PEFT adapter directory (its adapter_config.json), to build the model
    config a run starts from: tiny_config(..., lora=peft_lora_config(dir)) or
    dataclasses.replace(cfg, lora=peft_lora_config(dir)). Refuses what load_peft cannot load."""
    adapter_dir = Path(adapter_dir)
    config = _read_config(adapter_dir)
    path = adapter_dir / CONFIG_FILE
    if config.get("peft_type") != "LORA":
        raise ConfigError(
            f"{path}: peft_type={config.get('peft_type')!r} is not supported; only LORA adapters"
        )
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise ConfigError(
            f"{path}: task_type={config['task_type']!r} is not supported; only CAUSAL_LM adapters"
        )
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConfigError(f"{path}: r={r!r}: the rank must be a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise ConfigError(f"{path}: lora_alpha={alpha!r}: must be a positive number")
    if config.get("use_rslora"):
        # rsLoRA scales by alpha / sqrt(r): the same adapter as plain LoRA with another alpha.
        raise ConfigError(
            f"{path}: use_rslora=true (scale lora_alpha / sqrt(r)) is not supported; the same "
            f"adapter loads as plain LoRA: set use_rslora=false and lora_alpha={alpha * r**0.5:g}"
        )
    for field, what in _UNSUPPORTED.items():
        if config.get(field):
            raise ConfigError(
                f"{path}: {field}={config[field]!r} ({what}) is not supported; only plain LoRA "
                "loads: train the adapter without it"
            )
    if config.get("bias", "none") != "none":
        raise ConfigError(
            f"{path}: bias={config['bias']!r} (trained biases) is not supported; only "
            'bias="none" loads: train the adapter without it'
        )
    unknown = sorted(k for k, v in config.items() if v and k not in _KNOWN | set(_UNSUPPORTED))
    if unknown:
        raise ConfigError(
            f"{path}: unknown field {unknown[0]}={config[unknown[0]]!r} (a newer PEFT's option?) "
            "is not supported; only plain LoRA loads"
        )
    return lora.LoraConfig(
        rank=r, alpha=float(alpha), targets=_targets(config, path, _num_layers(adapter_dir))
    )


def check_peft(adapter_dir: str | os.PathLike, cfg: ModelConfig):
    """Checks a PEFT LoRA directory against `cfg` from its config and the safetensors header
    alone (no tensor is read): `cfg.lora` must be the directory's own (peft_lora_config), and
    every tensor present with its shape. Returns the open safetensors handle."""
    adapter_dir = Path(adapter_dir)
    found = peft_lora_config(adapter_dir)
    config_path = adapter_dir / CONFIG_FILE
    fix = (
        "leave model.lora unset to take the adapter's rank, alpha and targets "
        "(peft_lora_config), or set them to the adapter's"
    )
    want = cfg.lora
    if want is None:
        raise ConfigError(f"{adapter_dir}: the model config has no LoRA adapters; {fix}")
    if found.rank != want.rank:
        raise ConfigError(f"{config_path}: r={found.rank} but model.lora rank={want.rank}; {fix}")
    if found.alpha != want.alpha:
        raise ConfigError(
            f"{config_path}: lora_alpha={found.alpha:g} but model.lora alpha={want.alpha:g}; {fix}"
        )
    if set(found.targets) != set(want.targets):
        raise ConfigError(
            f"{config_path}: target_modules {list(found.targets)} but model.lora targets "
            f"{list(want.targets)}; {fix}"
        )
    path = adapter_dir / WEIGHTS_FILE
    if not path.exists():
        other = sorted(p.name for p in adapter_dir.glob("adapter_model*"))
        raise ConfigError(
            f"{path}: missing (found {other}); save the adapter with "
            "save_pretrained(..., safe_serialization=True)"
        )
    try:
        handle = safe_open(str(path), framework="numpy")
    except Exception as e:  # safetensors raises its own error types for corrupt files.
        raise ConfigError(f"{path}: cannot read safetensors file ({e}); re-save it") from None
    specs = _adapter_specs(cfg)
    expected = {PREFIX + s.hf.format(i=i) for s in specs for i in range(cfg.num_layers)}
    present = set(handle.keys())
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing:
        raise ConfigError(
            f"{path}: tensor {missing[0]!r} not found ({len(missing)} missing); the adapter "
            f"does not cover every layer of {list(found.targets)} or belongs to another model"
        )
    if unexpected:
        raise ConfigError(
            f"{path}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all); only "
            f"plain LoRA on {_ALL} in every one of the model's {cfg.num_layers} layers loads"
        )
    for s in specs:
        hf_shape = hf_io.hf_shape(s.key, params_lib.shape_of(s, cfg, per_layer=True), s.n_in)
        for i in range(cfg.num_layers):
            name = PREFIX + s.hf.format(i=i)
            got = tuple(handle.get_slice(name).get_shape())
            if got != hf_shape:
                raise ConfigError(
                    f"{path}: tensor {name!r} has shape {got} but r={want.rank} and the "
                    f"model config imply {hf_shape}; the adapter belongs to another base model"
                )
    return handle


def load_peft(adapter_dir: str | os.PathLike, cfg: ModelConfig) -> dict:
    """A PEFT LoRA directory's adapters in our layout: {"layers": {"q_proj_lora_a": [L, ...],
    ...}} of f32 numpy arrays (lora.ADAPTER_DTYPE, whatever the base's dtype), for
    lora.merge(adapters, base), after `check_peft`."""
    handle = check_peft(adapter_dir, cfg)
    dtype = jnp.dtype(lora.ADAPTER_DTYPE)
    layers = {}
    for s in _adapter_specs(cfg):
        shape = params_lib.shape_of(s, cfg, per_layer=True)
        host_Lx = np.empty((cfg.num_layers, *shape), dtype)
        for i in range(cfg.num_layers):
            tensor = handle.get_tensor(PREFIX + s.hf.format(i=i))
            host_Lx[i] = hf_io.to_ours(tensor, shape, s.n_in)
        layers[s.name] = host_Lx
    return {"layers": layers}
