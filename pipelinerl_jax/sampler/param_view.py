"""Model params -> the engine's view of them, once per version: full models and LoRA adapters.

Every version must arrive with the shapes, dtypes and structure of the first (a swap never
recompiles). The conversion casts what decoding reads narrower first (forward.publish_dtypes,
on the params' own devices, so a publish copies fewer bytes), places the params on the
sampler mesh (replicated, or split over its tp axis) and runs the engine's jitted
`prepare_params` (forward.decode_params: unstacked, cast, laid out).

With LoRA (model.lora), the first params are the whole model and later versions may be the
adapters alone (models/lora.split): the base's view is made once and kept, and each version
converts only the adapters and joins them to it (forward.with_adapters), so a publish moves
and converts adapter bytes only. The joined view has the one structure every version has.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as Ps

from pipelinerl_jax import sharding as shd
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, lora, shared_base
from pipelinerl_jax.sampler import forward as fwd


def input_shardings(params, mesh, tp_axis: str | None):
    """Where model params go on the sampler mesh before conversion: replicated, or split over
    the tp axis by the project's logical-axis rules (never whole on one device)."""
    if tp_axis is None:
        return jax.tree.map(lambda _: NamedSharding(mesh, Ps()), params)
    rules = tuple((name, tp_axis if axis == shd.TP else None) for name, axis in shd.RULES)
    return shd.param_shardings(params, mesh, rules)


def signature(params):
    """Tree structure, shapes and dtypes of model params (what a compiled chunk depends on)."""
    arrays = decoder.arrays(params)
    return jax.tree.structure(arrays), [(x.shape, x.dtype) for x in jax.tree.leaves(arrays)]


def is_adapters_only(params) -> bool:
    """True for the adapter subtree lora.split returns (no embedding, no base weights)."""
    tree = params if isinstance(params, dict) else dict(params)
    return set(tree) == {"layers"} and all(lora.is_adapter(k) for k in dict(tree["layers"]))


class ParamView:
    """Converts each version of the params for one engine (see the module docstring)."""

    def __init__(self, engine, model_cfg, params, share: ParamView | None = None):
        """share: with LoRA, another view of the same model on the same mesh whose base view
        this one reads (no second copy of the base); `params` may then be adapters alone."""
        self.engine, self.lora, self.model_cfg = engine, model_cfg.lora, model_cfg
        self.last_bytes = 0  # bytes the newest conversion placed on the sampler mesh
        if share is not None:
            if self.lora is None or share._base_view is None or share.engine.mesh != engine.mesh:
                raise ConfigError(
                    "share_base: needs a LoRA model and a sampler on the same mesh that has "
                    "converted its base"
                )
            for name in ("_narrow", "_signature", "_shardings", "_base_view"):
                setattr(self, name, getattr(share, name))
            self._adapter_signature = share._adapter_signature
            self._adapter_shardings = share._adapter_shardings
            return
        mesh, tp_axis = engine.mesh, engine.tp_axis
        # A publish moves params already cast to what decoding reads (forward.publish_dtypes).
        narrow = fwd.publish_dtypes(model_cfg, params, engine.ecfg.head_dtype)
        self._narrow = jax.jit(lambda p: fwd.narrow_for_decode(p, narrow)) if narrow else None
        self._signature = signature(params)
        self._shardings = input_shardings(params, mesh, tp_axis)
        self._base_view = None
        if self.lora is not None:
            adapters, _ = lora.split(decoder.arrays(params))
            self._adapter_signature = signature(adapters)
            self._adapter_shardings, _ = lora.split(decoder.arrays(self._shardings))

    def convert(self, params, *, copy: bool):
        """The engine's view of `params` (dispatched, not waited for). `copy`: never alias the
        given buffers (a trainer's, which its next step donates)."""
        may_alias = False if copy else None
        if self.lora is not None and is_adapters_only(params):
            return self._convert_adapters(params, may_alias)
        if signature(params) != self._signature:
            raise ConfigError(
                "new params' shapes/dtypes differ from the sampler's; load them "
                "with the same config and param_dtype (a swap must not "
                "recompile)"
            )
        if self._narrow is not None:
            params = self._narrow(params)  # on the params' own devices, before the copy
        placed = jax.device_put(params, self._shardings, may_alias=may_alias)
        self.last_bytes = _nbytes(params)
        if self.lora is None:
            return fwd.one_tied_table(self.model_cfg, self.engine.prepare_params(placed))
        adapters, base = lora.split(decoder.arrays(placed))
        self._base_view = fwd.one_tied_table(self.model_cfg, self.engine.prepare_base(base))
        return fwd.with_adapters(self._base_view, self.engine.prepare_adapters(adapters))

    def base_for_trainer(self) -> shared_base.SharedBase:
        """LoRA: the base's view, wrapped for a trainer on the same device to read instead of
        its own copy (models/shared_base.py; Trainer.read_base). ConfigError when it cannot
        read it exactly."""
        if self._base_view is None:
            raise ConfigError("base_for_trainer: the sampler holds no LoRA base view")
        why = shared_base.compatible(self.model_cfg, self._base_view)
        if why is not None:
            raise ConfigError(f"the trainer cannot read the sampler's base: {why}")
        return shared_base.from_view(
            self.model_cfg,
            self._base_view,
            self.engine.strategy.layout,
            tied=self.model_cfg.tie_word_embeddings,
        )

    def _convert_adapters(self, adapters, may_alias):
        if self._base_view is None:
            raise ConfigError("set_params with adapters alone: the sampler has no base model yet")
        if signature(adapters) != self._adapter_signature:
            raise ConfigError(
                "new adapters' shapes/dtypes differ from the sampler's; use the same model.lora "
                "rank and targets and param_dtype (a swap must not recompile)"
            )
        adapters = decoder.arrays(adapters)
        if self._narrow is not None:
            adapters = self._narrow(adapters)  # "layers" are read in the compute dtype
        placed = jax.device_put(adapters, self._adapter_shardings, may_alias=may_alias)
        self.last_bytes = _nbytes(adapters)
        return fwd.with_adapters(self._base_view, self.engine.prepare_adapters(placed))


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(decoder.arrays(tree)))
