"""The Engine: the device steps of sampler/steps.py jitted once per (model, shapes, mesh).

The steps are jitted with the state donated, under `shard_map` over the sampler
mesh (a 1-device mesh by default, so there is one code path). Data parallelism: slots and the
pool's pages are split in equal ranges over the devices of the data axis; block tables hold global page
ids and a slot only ever owns pages of its own shard, so inside the shard each device converts
ids to local ones (`MeshAxes.data`) and touches only its own pages. Tensor parallelism: when
the mesh also has a `tp` axis, params are split Megatron-style over it
(forward.decode_param_specs), the KV pool by kv heads, and the forward all-reduces the two
row-split projections per layer and all-gathers the logits (forward.py). Attention (the Triton
kernel included) then runs on each device's own heads with no communication; slot fields are
replicated over tp, and every device of a tp group samples the same token (same logits, same
per-token uniforms).

Dimension letters (pipelinerl_jax/__init__.py): R prefill rows, T prefill tokens.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as Ps

from pipelinerl_jax import sharding
from pipelinerl_jax.models import decoder
from pipelinerl_jax.sampler import forward as fwd
from pipelinerl_jax.sampler.state import SamplerState, state_shardings
from pipelinerl_jax.sampler.statics import EngineConfig, MeshAxes, strategy_of
from pipelinerl_jax.sampler.steps import copy_pages, decode_chunk, prefill, prepare_params, scale_of

_ENGINES: dict = {}


def get_engine(
    graphdef,
    ecfg: EngineConfig,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    tp_axis: str = "tp",
) -> Engine:
    """One Engine (hence one set of compiled executables) per (model, shapes, mesh)."""
    key = (graphdef, ecfg, mesh, data_axis, tp_axis)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(graphdef, ecfg, mesh, data_axis, tp_axis)
    return _ENGINES[key]


class Engine:
    """The free functions jitted once per shape, the state donated, under shard_map over a
    sampler mesh (module docstring). Build it with `get_engine`, so samplers of the same shapes
    share compiled functions.

      decode_chunk(params, state, version, k=, window=, width=)  prefill(params, state, tokens,
      positions, block_tables, window=)  copy_pages(state, src, dst)  prepare_params(params)
    """

    def __init__(
        self,
        graphdef,
        ecfg: EngineConfig,
        mesh: Mesh | None = None,
        data_axis: str = "data",
        tp_axis: str = "tp",
    ):
        self.graphdef = graphdef
        self.model_cfg = cfg = decoder.config_of(graphdef)
        self.ecfg = ecfg
        self.scale = scale_of(cfg)
        self.strategy = strategy_of(ecfg)  # raises ValueError naming a bad attention option
        self.attention = self.strategy.name
        if mesh is None:
            mesh = sharding.make_mesh((1,), (data_axis,), jax.local_devices()[:1])
        self.mesh, self.data_axis = mesh, data_axis
        self.num_shards = mesh.shape[data_axis]
        if ecfg.num_slots % self.num_shards or ecfg.num_pages % self.num_shards:
            raise ValueError(
                f"num_slots={ecfg.num_slots} and num_pages={ecfg.num_pages} must "
                f"divide by the {self.num_shards} devices of mesh axis {data_axis!r}"
            )
        self.pages_per_shard = ecfg.num_pages // self.num_shards
        # Tensor parallelism when the mesh has a tp axis of more than one device.
        self.tp = mesh.shape[tp_axis] if tp_axis in mesh.axis_names else 1
        self.tp_axis = tp_axis if self.tp > 1 else None
        fwd.check_tp(cfg, self.tp)
        self.axes = MeshAxes(data_axis, self.tp_axis, fwd.head_is_split(cfg, self.tp))
        self.shardings = state_shardings(mesh, data_axis, self.tp_axis)
        self.specs = jax.tree.map(lambda s: s.spec, self.shardings)
        self.replicated = NamedSharding(mesh, Ps())
        prepare = functools.partial(prepare_params, cfg=cfg, ecfg=ecfg)
        abstract = jax.eval_shape(prepare, decoder.abstract_init(cfg)[1])
        self.param_specs = fwd.decode_param_specs(
            cfg, abstract, self.tp_axis, self.tp, layout=self.strategy.layout
        )
        self.param_shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, spec), self.param_specs
        )
        self.decode_chunk = jax.jit(
            self._decode_chunk,
            static_argnames=("k", "window", "width"),
            donate_argnames=("state",),
        )
        self.prefill = jax.jit(
            self._prefill, static_argnames=("window",), donate_argnames=("state",)
        )
        self.copy_pages = jax.jit(self._copy_pages, donate_argnames=("state",))
        self.prepare_params = jax.jit(prepare, out_shardings=self.param_shardings)
        if cfg.lora is not None:
            # LoRA: the base's view is made once, each version's adapters alone (param_view.py).
            base_sh, adapter_sh = fwd.split_view(self.param_shardings)
            self.prepare_base = jax.jit(prepare, out_shardings=base_sh)
            self.prepare_adapters = jax.jit(
                functools.partial(fwd.decode_adapters, cfg, layout=self.strategy.layout),
                out_shardings=adapter_sh,
            )

    def _shard_map(self, fn, in_specs, out_specs):
        # check_vma off: every value is per-shard (no collectives), and the checker would
        # otherwise demand pcast annotations on every loop carry built from constants.
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def _statics(self):
        return dict(cfg=self.model_cfg, ecfg=self.ecfg, axes=self.axes)

    def _decode_chunk(
        self, params, state: SamplerState, version, *, k: int, window: int, width=None
    ):
        """width: slots decoded per data shard (the first ones; None: all)."""
        body = functools.partial(decode_chunk, k=k, window=window, width=width, **self._statics())
        return self._shard_map(body, (self.param_specs, self.specs, Ps()), self.specs)(
            params, state, version
        )

    def _prefill(self, params, state, tokens_RxT, positions_RxT, block_tables_RxM, *, window):
        """Rows are split over the data axis like slots: rows of shard d hold its slots' tables."""
        rows = Ps(self.data_axis)
        body = functools.partial(prefill, window=window, **self._statics())
        return self._shard_map(body, (self.param_specs, self.specs, rows, rows, rows), self.specs)(
            params, state, tokens_RxT, positions_RxT, block_tables_RxM
        )

    def _copy_pages(self, state: SamplerState, src_ids, dst_ids):
        """src/dst: global ids, [shards * n] split over the data axis (pad with null -> null)."""
        per_shard = Ps(self.data_axis)
        body = functools.partial(copy_pages, ecfg=self.ecfg, axes=self.axes)
        return self._shard_map(body, (self.specs, per_shard, per_shard), self.specs)(
            state, src_ids, dst_ids
        )
