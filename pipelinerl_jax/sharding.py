"""Logical-axis -> mesh-axis rules and the NamedShardings they give for params and batches.

Model params carry logical axis names (nnx metadata `sharding_names`, e.g. q_proj is
("layers", "embed", "q_heads", "head_dim")). One rule table maps each logical axis to a mesh
axis: FSDP shards the hidden ("embed") axis over "fsdp", tensor parallelism shards heads, MLP
and vocabulary over "tp". A rule is skipped (that dimension is replicated) when the mesh has no
such axis, when the dimension does not divide by the mesh axis size, or when the mesh axis is
already used by an earlier dimension of the same array.

The mesh axes a rule table maps to are the only ones it knows: `check_mesh` rejects a mesh with
any other axis name (its dimensions would silently be replicated). `make_mesh` is the one mesh
builder (the trainer's, the sampler's, the pipeline's).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipelinerl_jax.errors import ConfigError

FSDP, TP = "fsdp", "tp"
Rules = Iterable[tuple[str, str | None]]  # (logical axis, mesh axis or None) pairs

# logical axis -> mesh axis (or None: replicated). The one table every layout derives from.
RULES: tuple[tuple[str, str | None], ...] = (
    ("layers", None),  # scanned axis: never sharded
    ("vocab", TP),
    ("embed", FSDP),
    ("q_heads", TP),
    ("kv_heads", TP),
    ("head_dim", None),
    ("mlp", TP),
    ("norm", None),
    ("lora_rank", None),  # LoRA adapters' rank (models/lora.py): small, never split
    ("batch", FSDP),  # activations / batches: data-parallel over the fsdp axis
)


def mesh_axes(rules: Rules = RULES) -> tuple[str, ...]:
    """The mesh axes `rules` map logical axes to (the batch axis included), in rule order."""
    return tuple(dict.fromkeys(axis for _, axis in rules if axis is not None))


def batch_axis(rules: Rules = RULES) -> str | None:
    """The mesh axis batch rows are split over: the "batch" rule's (None: replicated)."""
    return dict(rules).get("batch")


def check_mesh(mesh: Mesh, rules: Rules = RULES) -> None:
    """ConfigError unless every axis of `mesh` is one the rules map to."""
    known = mesh_axes(rules)
    unknown = [name for name in mesh.axis_names if name not in known]
    if unknown:
        raise ConfigError(
            f"mesh axes {unknown} are unknown to the sharding rules (known axes: {list(known)}); "
            "name the mesh axes after them or pass rules that map logical axes onto these"
        )


def renamed(rules: Rules, mesh_axis_names: dict[str, str | None]) -> tuple:
    """The same rules onto other mesh axis names, e.g. the sampler's (data, tp) mesh:
    {FSDP: "data", TP: "tp"} (a name mapped to None replicates what it split)."""
    return tuple((logical, mesh_axis_names.get(axis, axis)) for logical, axis in rules)


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int] | None,
    mesh: Mesh,
    rules: Rules = RULES,
) -> PartitionSpec:
    """PartitionSpec for one array from its logical axis names, with divisibility fallback
    (shape None: the caller has checked divisibility)."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        axis = table.get(name) if name is not None else None
        divides = shape is None or (axis in mesh.shape and shape[i] % mesh.shape[axis] == 0)
        if axis is None or axis not in mesh.shape or axis in used or not divides:
            spec.append(None)
            continue
        used.add(axis)
        spec.append(axis)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def _names(var: nnx.Variable) -> tuple | None:
    meta = var.get_metadata()
    return meta.get("out_sharding", meta.get("sharding_names"))


def param_shardings(params: nnx.State, mesh: Mesh, rules: Rules = RULES) -> nnx.State:
    """A pytree like `params` (same structure, usable with device_put and jit) of NamedShardings.

    `params` may hold arrays or jax.ShapeDtypeStruct (from `decoder.abstract_init`).
    """
    rules = tuple(rules)

    def one(var):
        names = _names(var) or ()
        value = var.get_value()
        spec = logical_to_spec(names, value.shape, mesh, rules)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_specs(params: nnx.State, mesh: Mesh, rules: Rules = RULES) -> nnx.State:
    """Like `param_shardings` but PartitionSpecs (for shard_map / with_sharding_constraint)."""
    shardings = param_shardings(params, mesh, rules)
    return jax.tree.map(lambda s: s.spec, shardings)


def batch_sharding(
    mesh: Mesh, ndim: int, batch_size: int | None = None, rules: Rules = RULES
) -> NamedSharding:
    """Leading (batch) axis split over the data-parallel mesh axis, the rest replicated."""
    rules = tuple(rules)
    names = ("batch",) + (None,) * (ndim - 1)
    size = batch_size if batch_size is not None else mesh.shape.get(batch_axis(rules), 1)
    return NamedSharding(mesh, logical_to_spec(names, (size,) + (1,) * (ndim - 1), mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def make_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str] = (FSDP, TP),
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh with Auto axis types: the model leaves propagation to XLA (GSPMD).

    jax.make_mesh defaults to Explicit axes, under which the forward's einsums would each need
    an explicit out_sharding; Auto lets the param shardings alone decide the layout. With
    `devices`, they fill the mesh in order (row-major: the last axis holds consecutive
    devices); without, jax.make_mesh picks an order suited to the hardware's topology.
    """
    shape, axis_names = tuple(shape), tuple(axis_names)
    if len(shape) != len(axis_names):
        raise ConfigError(f"mesh shape {shape} and axis names {axis_names} differ in length")
    axis_types = (jax.sharding.AxisType.Auto,) * len(axis_names)
    if devices is None:
        return jax.make_mesh(shape, axis_names, axis_types=axis_types)
    import numpy as np

    devices = np.asarray(devices)
    if devices.size != math.prod(shape):
        raise ConfigError(
            f"a mesh of shape {shape} needs {math.prod(shape)} devices, got {devices.size}"
        )
    return Mesh(devices.reshape(shape), axis_names, axis_types=axis_types)
