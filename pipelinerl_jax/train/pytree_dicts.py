"""Pytrees as a checkpoint stores them: nested dicts keyed by their tree paths.

    nested = to_nested(state.params)        # {"embed": {"value": array}, "layers": {...}}
    params = from_nested(nested, like)      # back into `like`'s own structure
    leaf_manifest(state.params)             # {"embed/value": [[V, E], "float32"], ...}
    abstract = abstract_state(trainer, abstract_params)   # a restore target, on shardings

A checkpoint holds path-keyed nested dicts (`opt_state/1/0/mu/embed/value`), not the pytree
objects themselves: any pytree (nnx.State, optax namedtuples, flax structs) saves the same way
and restores into the caller's own structure. The leaf manifest (shape and dtype per path) is
what a checkpoint's meta item records and what a restore compares before reading arrays; the
abstract trees (ShapeDtypeStructs with shardings) are what a restore reads onto.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            name = str(getattr(entry, attr))
            break
    else:
        name = str(entry)
    # Orbax joins nested keys with "." into array names; keep names unambiguous.
    return name.replace(".", "_").replace("/", "_")


def _leaf_paths(tree) -> tuple[list[tuple[str, ...]], list[Any], Any]:
    """(path parts per leaf, leaves, treedef); None subtrees have no leaves."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [tuple(_key_name(e) for e in path) for path, _ in with_path]
    if len(set(paths)) != len(paths):
        raise ValueError("pytree has leaves whose path names collide; cannot checkpoint it")
    return paths, [leaf for _, leaf in with_path], treedef


def to_nested(tree) -> dict:
    """Nested dict {part: {part: leaf}} of a pytree, keyed by its tree paths."""
    nested: dict = {}
    for parts, leaf in zip(*_leaf_paths(tree)[:2]):
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1] if parts else "value"] = leaf
    return nested


def from_nested(nested: dict, like) -> Any:
    """The pytree `like` with its leaves taken from `nested` (same path keys)."""
    paths, _, treedef = _leaf_paths(like)
    leaves = []
    for parts in paths:
        node = nested
        for part in parts or ("value",):
            node = node[part]
        leaves.append(node)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def leaf_manifest(tree) -> dict[str, list]:
    """{"a/b/c": [shape, dtype]} for every leaf: what the meta item records and restore checks."""
    paths, leaves, _ = _leaf_paths(tree)
    return {
        "/".join(p) or "value": [list(np.shape(x)), str(np.dtype(x.dtype))]
        for p, x in zip(paths, leaves)
    }


def _default_sharding():
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def as_abstract(tree) -> Any:
    """ShapeDtypeStructs with a sharding for every leaf (arrays keep theirs; default device)."""

    def one(x):
        sharding = getattr(x, "sharding", None) or _default_sharding()
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def abstract_state(trainer, abstract_params) -> Any:
    """The TrainState a `trainer` would create, as ShapeDtypeStructs on its state shardings."""
    shapes = jax.eval_shape(trainer.init_state, abstract_params)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        trainer.state_shardings,
    )
