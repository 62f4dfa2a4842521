"""LoRA adapters as rows of the parameter table: y = x·W + (alpha / rank) · (x·A)·B.

An adapted projection `name` (q_proj, ..., down_proj) gains two per-layer params beside it:

- `{name}_lora_a`: the projection's input dims then the rank, e.g. q_proj's [L, E, J] and
  o_proj's [L, H, D, J] (n_in as the projection's: x·A contracts the same input dims);
- `{name}_lora_b`: the rank then the projection's output dims, e.g. q_proj's [L, J, H, D].

A is drawn as PEFT draws it (kaiming-uniform with a = sqrt(5): uniform(+-1/sqrt(fan_in))) and B
starts at zero, so a fresh adapter leaves the model exactly the base model. The scale is
PEFT's alpha / rank. Both layouts of block.py run the same two matmuls (`adapted`), so the
trainer's forward and the sampler's decode compute the same LoRA term.

Why not qwix: its LoRA provider intercepts the dot_generals of nnx.Linear / nnx.Einsum modules
and attaches one adapter per intercepted module instance; our layers are a `lax.scan` over
params stacked [L, ...] (and the sampler's unrolled, transposed copy of them), so there is one
traced matmul for all L layers and no module per layer to attach to. Rows in the table give the
adapters the same logical axes, sharding, checkpointing and layouts as every other param.

`split` and `merge` separate the trainable adapters from the frozen base (the trainer
differentiates only the former; a swap publishes only the former), `merged_weights` folds the
adapters into the base (HF export, the merged decode path).

Letters (see pipelinerl_jax/__init__.py): L layers, E hidden, H heads, D head dim, J LoRA rank,
I input features, O output features.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.errors import ConfigError

# The projections an adapter may target (models/params.py names), and PEFT's module names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
RANK_AXIS = "lora_rank"  # the logical axis of the rank (never sharded: sharding.RULES)
# Adapters stay f32 whatever model.param_dtype: a bf16 base halves the frozen weights' memory,
# while the small trained matrices keep full precision for their updates.
ADAPTER_DTYPE = "float32"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Adapters on `targets` of every layer, of `rank`, scaled by alpha / rank (PEFT's)."""

    rank: int = 16  # J: the adapters' inner dimension
    alpha: float = 32.0  # the LoRA term is scaled by alpha / rank (PEFT's lora_alpha)
    targets: tuple[str, ...] = TARGETS  # projections to adapt: q, k, v, o, gate, up, down

    def __post_init__(self):
        if isinstance(self.targets, str) or not isinstance(self.targets, (tuple, list)):
            raise ConfigError(
                f"model.lora targets={self.targets!r}: give a list of projections from {TARGETS}"
            )
        targets = tuple(_full_name(t) for t in self.targets)
        object.__setattr__(self, "targets", targets)
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError(f"model.lora rank={self.rank!r}: use a positive integer, e.g. 16")
        alpha = self.alpha
        if not isinstance(alpha, (int, float)) or not (alpha > 0 and math.isfinite(alpha)):
            raise ConfigError(
                f"model.lora alpha={self.alpha!r}: use a positive finite number, e.g. 32"
            )
        object.__setattr__(self, "alpha", float(self.alpha))
        if not targets:
            raise ConfigError(f"model.lora targets is empty: name projections from {TARGETS}")
        if len(set(targets)) != len(targets):
            raise ConfigError(f"model.lora targets={list(self.targets)} names one twice")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def as_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


def _full_name(target) -> str:
    """'q' or 'q_proj' -> 'q_proj'; anything else is refused in one line."""
    name = str(target)
    name = name if name.endswith("_proj") else f"{name}_proj"
    if name not in TARGETS:
        short = ", ".join(t.removesuffix("_proj") for t in TARGETS)
        raise ConfigError(f"model.lora targets: {target!r} is not a projection; use {short}")
    return name


def lora_config(value) -> LoraConfig | None:
    """A LoraConfig from a config value: None, {} or rank 0 (no adapters), a dict, or a
    LoraConfig."""
    if value is None or isinstance(value, LoraConfig):
        return value
    if hasattr(value, "to_dict"):  # ml_collections.ConfigDict
        value = value.to_dict()
    if not isinstance(value, dict):
        raise ConfigError(
            f"model.lora={value!r}: give a dict such as "
            '{"rank": 16, "alpha": 32, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}'
        )
    unknown = sorted(set(value) - {"rank", "alpha", "targets"})
    if unknown:
        raise ConfigError(f"model.lora: unknown keys {unknown}; use rank, alpha, targets")
    if not value or value.get("rank") == 0:
        # A rank turns LoRA on: alpha or targets without one would train the whole model.
        defaults = LoraConfig().as_dict()
        set_alone = [
            k
            for k in ("alpha", "targets")
            if k in value and _normal(k, value[k]) != _normal(k, defaults[k])
        ]
        if set_alone:
            raise ConfigError(
                f"model.lora {' and '.join(set_alone)} set without a rank (rank 0 is off, a "
                "full fine-tune): add --config.model.lora.rank=16, or leave "
                + ("it" if len(set_alone) == 1 else "them")
                + " out"
            )
        return None
    return LoraConfig(**value)


def _normal(key: str, value):
    """A lora field's value as compared with its default (targets by full name, any order)."""
    if key == "targets" and isinstance(value, (list, tuple)):
        return sorted(_full_name(t) if isinstance(t, str) else t for t in value)
    return value


def check_rank(lora: LoraConfig, shapes: dict[str, tuple[int, int]]) -> None:
    """Refuses a rank above a target's smaller side: (x·A)·B has rank <= min(in, out) whatever
    the rank, so the rest is memory and compute for nothing. `shapes`: projection -> (in, out)
    features."""
    for target in lora.targets:
        smallest = min(shapes[target])
        if lora.rank > smallest:
            raise ConfigError(
                f"model.lora rank={lora.rank} exceeds {target}'s {shapes[target][0]} x "
                f"{shapes[target][1]} (an update of rank <= {smallest}): use a rank <= "
                f"{min(min(shapes[t]) for t in lora.targets)}"
            )


def is_adapter(name: str) -> bool:
    """True for an adapter param's name ("q_proj_lora_a") or path ("layers/q_proj_lora_b")."""
    return name.endswith(SUFFIX_A) or name.endswith(SUFFIX_B)


def init_a(rng, shape: tuple[int, ...], n_in: int) -> jax.Array:
    """PEFT's kaiming-uniform(a=sqrt(5)) draw for A: uniform(+-1/sqrt(fan_in)), f32."""
    bound = 1.0 / math.sqrt(math.prod(shape[1 : 1 + n_in]))
    return jax.random.uniform(rng, shape, jnp.float32, -bound, bound)


def adapted(layout, x, lp: dict, name: str, n_in: int, scale: float):
    """The projection `name` of x, plus its LoRA term when `lp` holds its adapter.

    The adapter is two matmuls through the rank (x·A, then ·B), never the [I, O] product A·B:
    that is rank / min(I, O) of the FLOPs and no weight-sized temporary."""
    y = layout.project(x, lp[name], n_in)
    a = lp.get(name + SUFFIX_A)
    if a is None:
        return y
    low = layout.project(x, a, n_in)
    return y + layout.project(low, lp[name + SUFFIX_B], 1) * jnp.asarray(scale, y.dtype)


def _tree(params) -> dict:
    return params if isinstance(params, dict) else dict(params)  # nnx.State is a Mapping


def split(params) -> tuple[dict, dict]:
    """(adapters, base): the adapter leaves under "layers", and everything else. Either is a
    plain dict of the params' own leaves (arrays, Variables, shardings or shapes)."""
    tree = _tree(params)
    layers = _tree(tree["layers"])
    adapters = {"layers": {k: v for k, v in layers.items() if is_adapter(k)}}
    base = {k: v for k, v in tree.items() if k != "layers"}
    base["layers"] = {k: v for k, v in layers.items() if not is_adapter(k)}
    return adapters, base


def merge(adapters: dict, base: dict) -> dict:
    """The inverse of `split`: one params dict holding both."""
    tree = dict(_tree(base))
    tree["layers"] = {**_tree(tree["layers"]), **_tree(adapters["layers"])}
    return tree


def merged_weights(params: dict, lora: LoraConfig) -> dict:
    """The base params with every adapter folded in (W + scale · A·B, f32 math, rounded to W's
    dtype) and the adapter params dropped: the model a PEFT merge gives. `params`: a nested
    dict of arrays (decoder.arrays)."""
    adapters, base = split(params)
    layers = dict(base["layers"])
    for target in lora.targets:
        w = layers[target]
        a = adapters["layers"][target + SUFFIX_A].astype(jnp.float32)
        b = adapters["layers"][target + SUFFIX_B].astype(jnp.float32)
        a_LxIxJ = a.reshape(a.shape[0], -1, a.shape[-1])
        b_LxJxO = b.reshape(b.shape[0], b.shape[1], -1)
        delta = jnp.einsum("lij,ljo->lio", a_LxIxJ, b_LxJxO, precision="highest")
        layers[target] = (w.astype(jnp.float32) + lora.scale * delta.reshape(w.shape)).astype(
            w.dtype
        )
    return {**base, "layers": layers}


def fingerprint(base) -> str:
    """sha256 of the frozen base's arrays (names, shapes, dtypes and bytes, in name order): what
    a LoRA checkpoint records, so a resume on other base weights is refused."""
    digest = hashlib.sha256()
    # nnx.Variables as their arrays, so a State and its pure dict give one fingerprint.
    has_value = lambda v: hasattr(v, "get_value")  # noqa: E731
    base = jax.tree.map(lambda v: v.get_value() if has_value(v) else v, base, is_leaf=has_value)
    flat = jax.tree_util.tree_flatten_with_path(base)[0]
    for path, x in sorted(flat, key=lambda item: jax.tree_util.keystr(item[0])):
        host = np.ascontiguousarray(jax.device_get(x))
        digest.update(f"{jax.tree_util.keystr(path)}{host.shape}{host.dtype}".encode())
        digest.update(host.view(np.uint8).reshape(-1).data)
    return digest.hexdigest()
