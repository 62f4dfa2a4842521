"""One copy of a LoRA run's frozen base: the trainer reads the sampler's converted base.

Under LoRA (models/lora.py) the base never changes, so on one shared device the trainer needs
no copy of its own: the sampler already holds one, converted for decoding
(sampler/forward.decode_params: unstacked into per-layer dicts, cast to the compute dtype, each
projection laid out for the block layout, the head vocabulary-major). `SharedBase` wraps that
view for the trainer's scanned forward (decoder.forward_hidden):

- layer i is picked inside the scan by `lax.switch` over the per-layer dicts, and turned back
  to its stored shape there, so at any moment one layer's weights are copied, never a stacked
  [L, ...] tree (the branch's operands are the view's buffers, passed by reference);
- the embedding, final norm and head are the view's own arrays.

Exact only when the view holds the stored values: the compute dtype is the param dtype and the
head's dtype is too or f32 (`compatible` checks; the trainer casts every weight to the compute dtype
and the head to f32 before use, so reading the view then gives the same numbers). `stacked`
rebuilds the plain base tree (an export, a checkpoint, an evaluation without a sampler).

Letters (see pipelinerl_jax/__init__.py): L layers, V vocabulary, E hidden, I input features,
O output features.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pipelinerl_jax.models import lora, registry
from pipelinerl_jax.models import params as param_table
from pipelinerl_jax.models.config import ModelConfig

LAYOUTS = ("token_major", "feature_major")


@dataclasses.dataclass(frozen=True)
class SharedBase:
    """A sampler's decode view of a frozen base, read by the trainer (module docstring)."""

    embed_VxE: jax.Array  # compute dtype (a 16-bit table as its uint16 bit patterns)
    layers: tuple[dict, ...]  # per layer: {name: weight as `layout` lays it out}
    final_norm: jax.Array
    head_VxE: jax.Array
    tied: bool  # the head is the embedding's transpose (no lm_head param of its own)
    layout: str  # "token_major" (stored shapes) | "feature_major" (projections [O, I])
    dtype: str  # the compute dtype, which is the param dtype (`compatible`)
    # (name, n_in, stored per-layer shape) of every per-layer base param.
    layer_params: tuple[tuple[str, int, tuple[int, ...]], ...]

    def layer(self, i: jax.Array) -> dict:
        """Layer i's base params in their stored shapes, for a traced layer index."""
        branches = [lambda layers, j=j: self._stored(layers[j]) for j in range(len(self.layers))]
        return jax.lax.switch(i, branches, self.layers)

    def _stored(self, lp: dict) -> dict:
        if self.layout == "token_major":
            return dict(lp)
        out = {}
        for name, n_in, shape in self.layer_params:
            w = lp[name]
            out[name] = w.T.reshape(shape) if n_in else w
        return out

    def embed_table(self) -> jax.Array:
        """The embedding [V, E] in the param dtype (a uint16 table viewed back)."""
        if self.embed_VxE.dtype != jnp.uint16:
            return self.embed_VxE
        return jax.lax.bitcast_convert_type(self.embed_VxE, jnp.dtype(self.dtype))

    def head_ExV(self) -> jax.Array:
        """The output projection [E, V] (decoder.lm_head_weight's layout)."""
        return self.head_VxE.T

    def stacked(self) -> dict:
        """The plain base tree {embed, layers: {name: [L, ...]}, final_norm[, lm_head]}, as
        lora.split returns it: a full copy, for the rare reader that needs stored params."""
        layers = [self._stored(lp) for lp in self.layers]
        tree = {
            "embed": self.embed_table(),
            "layers": {n: jnp.stack([lp[n] for lp in layers]) for n, _, _ in self.layer_params},
            "final_norm": self.final_norm,
        }
        if not self.tied:
            tree["lm_head"] = self.head_ExV().astype(self.dtype)
        return tree


jax.tree_util.register_dataclass(
    SharedBase,
    data_fields=["embed_VxE", "layers", "final_norm", "head_VxE"],
    meta_fields=["tied", "layout", "dtype", "layer_params"],
)


def compatible(cfg: ModelConfig, view: dict) -> str | None:
    """Why the trainer cannot read this decode view of the base exactly, or None if it can."""
    if cfg.lora is None:
        return "only a LoRA run's base is frozen"
    if jnp.dtype(cfg.compute_dtype) != jnp.dtype(cfg.param_dtype):
        return (
            f"the sampler holds the base in compute_dtype={cfg.compute_dtype}, the trainer "
            f"needs param_dtype={cfg.param_dtype}"
        )
    head, stored = jnp.dtype(view["head_VxE"].dtype), jnp.dtype(cfg.param_dtype)
    if head != stored and head != jnp.float32:  # an f32 copy of a 16-bit head is exact
        return f"the sampler's head is {head}, the base's {stored}"
    return None


def from_view(cfg: ModelConfig, view: dict, layout: str, tied: bool) -> SharedBase:
    """Wraps a base's decode view (sampler/forward.decode_params of lora.split's base)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")
    sizes = param_table.axis_sizes(cfg)
    layer_params = tuple(
        (s.name, s.n_in, tuple(sizes[a] for a in s.layer_axes))
        for s in registry.family_of(cfg.model_type).param_table(cfg)
        if s.per_layer
    )
    names = {name for name, _, _ in layer_params}
    for j, lp in enumerate(view["layers"]):
        if set(lp) != names:
            raise ValueError(f"layer {j} of the view holds {sorted(lp)}, the base {sorted(names)}")
    for name, n_in, shape in layer_params:
        got, want = tuple(view["layers"][0][name].shape), shape
        if layout == "feature_major" and n_in:
            want = (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
        if got != want:
            raise ValueError(f"{name}: the view's {tuple(got)} is not {layout}'s {tuple(want)}")
    return SharedBase(
        embed_VxE=view["embed"],
        layers=tuple(view["layers"]),
        final_norm=view["final_norm"],
        head_VxE=view["head_VxE"],
        tied=tied,
        layout=layout,
        dtype=jnp.dtype(cfg.compute_dtype).name,
        layer_params=layer_params,
    )


def join(adapters: dict, base) -> dict:
    """lora.merge for either form of the base: the trainer's params for one forward."""
    if isinstance(base, SharedBase):
        return {"layers": dict(adapters["layers"]), "shared": base}
    return lora.merge(adapters, base)


def stored(base) -> dict:
    """The plain base tree for either form (SharedBase.stacked copies)."""
    return base.stacked() if isinstance(base, SharedBase) else base
