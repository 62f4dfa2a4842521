"""Logical-axis -> mesh-axis rules and the NamedShardings they give for params and batches.

Model params carry logical axis names (nnx metadata `sharding_names`, e.g. q_proj is
("layers", "embed", "q_heads", "head_dim")). One rule table maps each logical axis to a mesh
axis: FSDP shards the hidden ("embed") axis over "fsdp", tensor parallelism shards heads, MLP
and vocabulary over "tp". A rule is skipped (that dimension is replicated) when the mesh has no
such axis, when the dimension does not divide by the mesh axis size, or when the mesh axis is
already used by an earlier dimension of the same array.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

FSDP, TP = "fsdp", "tp"

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
    ("batch", FSDP),  # activations / batches: data-parallel over the fsdp axis
)


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Iterable[tuple[str, str | None]] = RULES,
) -> PartitionSpec:
    """PartitionSpec for one array from its logical axis names, with divisibility fallback."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, size in zip(names, shape):
        axis = table.get(name) if name is not None else None
        if axis is None or axis not in mesh.shape or axis in used or size % mesh.shape[axis] != 0:
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


def param_shardings(
    params: nnx.State, mesh: Mesh, rules: Iterable[tuple[str, str | None]] = RULES
) -> nnx.State:
    """A pytree like `params` (same structure, usable with device_put and jit) of NamedShardings.

    `params` may hold arrays or jax.ShapeDtypeStruct (from `llama.abstract_init`).
    """
    rules = tuple(rules)

    def one(var):
        names = _names(var) or ()
        value = var.get_value()
        spec = logical_to_spec(names, value.shape, mesh, rules)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_specs(
    params: nnx.State, mesh: Mesh, rules: Iterable[tuple[str, str | None]] = RULES
) -> nnx.State:
    """Like `param_shardings` but PartitionSpecs (for shard_map / with_sharding_constraint)."""
    shardings = param_shardings(params, mesh, rules)
    return jax.tree.map(lambda s: s.spec, shardings)


def batch_sharding(mesh: Mesh, ndim: int, batch_size: int | None = None) -> NamedSharding:
    """Leading (batch) axis split over the data-parallel mesh axis, the rest replicated."""
    names = ("batch",) + (None,) * (ndim - 1)
    shape = (batch_size if batch_size is not None else mesh.shape.get(FSDP, 1),) + (1,) * (ndim - 1)
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def make_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str] = (FSDP, TP),
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh with Auto axis types: the model leaves propagation to XLA (GSPMD).

    jax.make_mesh defaults to Explicit axes, under which the forward's einsums would each need
    an explicit out_sharding; Auto lets the param shardings alone decide the layout.
    """
    axis_types = (jax.sharding.AxisType.Auto,) * len(axis_names)
    if devices is None:
        return jax.make_mesh(tuple(shape), tuple(axis_names), axis_types=axis_types)
    import numpy as np

    return Mesh(np.asarray(devices).reshape(tuple(shape)), tuple(axis_names), axis_types=axis_types)
