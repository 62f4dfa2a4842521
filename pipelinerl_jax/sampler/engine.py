"""Pure jitted engine functions over SamplerState: decode_chunk, prefill, copy_pages.

  prepare_params(model_params) -> params
      the per-layer view the engine runs on (forward.py), replicated on the sampler mesh.
  decode_chunk(params, state, version, k, window) -> state
      k decode steps in one jit (lax.scan), the state donated. Params are an ordinary
      argument: any params pytree with the same shapes/dtypes/shardings reuses the compiled
      executable, so a weight swap between chunks never recompiles. `version` is a traced
      int32 scalar stamped on every token of the chunk.
  prefill(params, state, tokens, positions, block_tables, window) -> state
      writes K/V of one chunk of prompt tokens per row into the rows' pages (no logits: the
      first new token is sampled by the decode step that consumes the last prompt token).
  copy_pages(state, src, dst) -> state
      copies pages (all layers): a group's attempts each get a private copy of the prompt's
      partially filled last page.

Data parallelism: every function runs under `shard_map` over the sampler mesh's data axis
(a 1-device mesh by default, so there is one code path). Slots and the pool's pages are split
in D equal ranges; block tables hold global page ids and a slot only ever owns pages of its own
shard, so inside the shard each device converts ids to local ones and touches only its own
pages. Params are replicated over the data axis.

Tensor parallelism: when the mesh also has a `tp` axis, params are split Megatron-style over
it (forward.decode_param_specs), the KV pool by kv heads, and the forward all-reduces the two
row-split projections per layer and all-gathers the logits (forward.py). Attention (the Triton
kernel included) then runs on each device's own heads with no communication; slot fields are
replicated over tp, and every device of a tp group samples the same token (same logits, same
per-token uniforms).

`window` (static) is how many leading block-table pages attention reads per row; the host
picks it from a small set of buckets so reads scale with the longest live sequence, not with
max_seq_len, at a handful of compiles.

Dimension letters: B slots, R prefill rows, T prefill tokens, C chunk steps, V vocabulary,
L layers, M pages per slot, W window pages.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as Ps

from pipelinerl_jax.kernels.paged_attention import triton_available
from pipelinerl_jax.models import llama
from pipelinerl_jax.sampler import attend as attn
from pipelinerl_jax.sampler import forward as fwd
from pipelinerl_jax.sampler import sampling, staged
from pipelinerl_jax.sampler.state import SamplerState, state_shardings

ATTENTION_IMPLS = ("auto", "staged", "paged", "gather")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shapes of the engine (hashable)."""

    num_slots: int  # B
    page_size: int  # S
    num_pages: int  # P per layer, including the null page
    pages_per_slot: int  # M
    max_stop_tokens: int  # X
    cache_dtype: str = "float32"
    truncated_logprobs: bool = False  # see sampling.py: default records tempered logprobs
    attention: str = "auto"  # decode attention: "paged" writes the step's K/V into the pool and
    #   calls kernels.paged_decode_attention (the Triton kernel on
    #   NVIDIA GPUs, its jnp reference elsewhere); "staged" also writes
    #   the pool but reads a dense copy of the window made once per
    #   chunk (staged.py; the CPU path); "gather" merges the new token
    #   with the gathered pages itself (attend.decode_attend); "auto":
    #   "paged" where the Triton kernel runs, else "staged".
    #   Measured on the bench model (CPU, 8 layers, context 160, batch
    #   64, one step): staged ~18 ms of attention, paged ~43 ms.


def window_buckets(max_pages: int) -> tuple[int, ...]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... (powers of 2 and 1.5x) capped at max_pages."""
    out, p = set(), 1
    while p < max_pages:
        out.update({p, p + p // 2} if p >= 2 else {p})
        p *= 2
    out.add(max_pages)
    return tuple(sorted(b for b in out if b <= max_pages))


def pick_window(needed_pages: int, max_pages: int) -> int:
    """Smallest bucket >= needed_pages (>= 1)."""
    needed_pages = max(1, min(needed_pages, max_pages))
    return next(b for b in window_buckets(max_pages) if b >= needed_pages)


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
    """Holds the model graphdef and the jitted engine functions (compiled once per shape).

    Build it with `get_engine`, so samplers of the same shapes share compiled functions.
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
        self.model_cfg = llama.config_of(graphdef)
        self.ecfg = ecfg
        self.scale = 1.0 / math.sqrt(self.model_cfg.head_dim)
        if ecfg.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention={ecfg.attention!r}: use one of {ATTENTION_IMPLS}")
        self.attention = ecfg.attention
        if self.attention == "auto":
            self.attention = "paged" if triton_available() else "staged"
        if mesh is None:
            mesh = Mesh(np.asarray(jax.devices()[:1]), (data_axis,))
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
        fwd.check_tp(self.model_cfg, self.tp)
        self.shardings = state_shardings(mesh, data_axis, self.tp_axis)
        self.specs = jax.tree.map(lambda s: s.spec, self.shardings)
        self.replicated = NamedSharding(mesh, Ps())
        abstract = jax.eval_shape(
            functools.partial(fwd.decode_params, self.model_cfg),
            llama.abstract_init(self.model_cfg)[1],
        )
        self.param_specs = fwd.decode_param_specs(self.model_cfg, abstract, self.tp_axis, self.tp)
        self.param_shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, spec), self.param_specs
        )
        self._gather_logits = self.tp_axis if fwd.head_is_split(self.model_cfg, self.tp) else None
        self._reduce = (lambda x: jax.lax.psum(x, self.tp_axis)) if self.tp_axis else None
        self.decode_chunk = jax.jit(
            self._decode_chunk, static_argnames=("k", "window"), donate_argnames=("state",)
        )
        self.prefill = jax.jit(
            self._prefill, static_argnames=("window",), donate_argnames=("state",)
        )
        self.copy_pages = jax.jit(self._copy_pages, donate_argnames=("state",))
        self.prepare_params = jax.jit(
            functools.partial(fwd.decode_params, self.model_cfg), out_shardings=self.param_shardings
        )

    def _shard_map(self, fn, in_specs, out_specs):
        # check_vma off: every value is per-shard (no collectives), and the checker would
        # otherwise demand pcast annotations on every loop carry built from constants.
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def _to_local(self, page_ids):
        """Global page ids -> ids inside this device's range of the pool."""
        return page_ids - jax.lax.axis_index(self.data_axis) * self.pages_per_shard

    # --- decode ---------------------------------------------------------------------------

    def _decode_chunk(self, params, state: SamplerState, version, *, k: int, window: int):
        body = functools.partial(self._decode_chunk_local, k=k, window=window)
        return self._shard_map(body, (self.param_specs, self.specs, Ps()), self.specs)(
            params, state, version
        )

    def _decode_chunk_local(self, params, state: SamplerState, version, *, k: int, window: int):
        block_tables_BxM = self._to_local(state.block_tables)
        step = functools.partial(self._decode_step, params, block_tables_BxM, window)
        stage = None
        if self.attention == "staged":
            # K/V are cached for positions < lengths - 1 (the last token's come this step).
            stage = staged.stage(
                state.k_pages, state.v_pages, block_tables_BxM[:, :window], state.lengths - 1
            )
            # 16-bit caches travel through the loop as their bit patterns, so the per-step
            # writes are integer scatters with no conversion copies (attend.set_at says why).
            stage = jax.tree.map(attn.bits_view, stage)
            state = state.replace(
                k_pages=attn.bits_view(state.k_pages), v_pages=attn.bits_view(state.v_pages)
            )
        (state, _), (tokens_CxB, logprobs_CxB, valid_CxB) = jax.lax.scan(
            step, (state, stage), None, length=k
        )
        if self.attention == "staged":
            cache_dtype = jnp.dtype(self.ecfg.cache_dtype)
            state = state.replace(
                k_pages=attn.float_view(state.k_pages, cache_dtype),
                v_pages=attn.float_view(state.v_pages, cache_dtype),
            )
        version = jnp.asarray(version, jnp.int32)
        return state.replace(
            out_tokens=tokens_CxB.T,
            out_logprobs=logprobs_CxB.T,
            out_valid=valid_CxB.T,
            out_versions=jnp.where(valid_CxB.T, version, -1),
        )

    def _decode_step(self, params, block_tables_BxM, window, state_and_stage, _):
        state, stage = state_and_stage
        positions_B = state.lengths - 1
        active_B = state.active
        tokens_Bx1 = state.last_token[:, None]
        if self.attention == "staged":
            attend = staged.decode_attend_staged(
                block_tables_BxM,
                positions_B,
                active_B,
                scale=self.scale,
                cache_dtype=self.ecfg.cache_dtype,
            )
            hidden_Bx1xE, (k_pages, v_pages, *stage) = fwd.forward_hidden(
                self.model_cfg,
                params,
                tokens_Bx1,
                positions_B[:, None],
                attend,
                (state.k_pages, state.v_pages, *stage),
                self._reduce,
            )
            stage = tuple(stage)
        elif self.attention == "paged":
            attend = attn.decode_attend_paged(
                block_tables_BxM, positions_B, active_B, window, scale=self.scale
            )
            hidden_Bx1xE, (k_pages, v_pages) = fwd.forward_hidden(
                self.model_cfg,
                params,
                tokens_Bx1,
                positions_B[:, None],
                attend,
                (state.k_pages, state.v_pages),
                self._reduce,
            )
        else:
            attend = attn.decode_attend(
                state.k_pages,
                state.v_pages,
                block_tables_BxM[:, :window],
                positions_B,
                scale=self.scale,
            )
            hidden_Bx1xE, kv = fwd.forward_hidden(
                self.model_cfg, params, tokens_Bx1, positions_B[:, None], attend, (), self._reduce
            )
            k_new, v_new = _stack_kv(kv)
            write_Bx1 = active_B[:, None]
            k_pages = attn.write_new_kv(
                state.k_pages, k_new, block_tables_BxM, positions_B[:, None], write_Bx1
            )
            v_pages = attn.write_new_kv(
                state.v_pages, v_new, block_tables_BxM, positions_B[:, None], write_Bx1
            )
        logits_VxB = fwd.logits_vocab_major(params, hidden_Bx1xE[:, 0].T, self._gather_logits)
        u_B = _uniforms(state.rng_key, state.seeds, state.lengths)
        tokens_B, logprobs_B = sampling.sample_vocab_major(
            logits_VxB,
            state.temperature,
            state.top_k,
            state.top_p,
            u_B,
            truncated=self.ecfg.truncated_logprobs,
        )
        lengths_B = state.lengths + active_B.astype(jnp.int32)
        stopped_B = jnp.any(state.stop_tokens == tokens_B[:, None], axis=-1)
        done_B = active_B & (stopped_B | (lengths_B >= state.limit))
        state = state.replace(
            k_pages=k_pages,
            v_pages=v_pages,
            last_token=jnp.where(active_B, tokens_B, state.last_token),
            lengths=lengths_B,
            active=active_B & ~done_B,
        )
        return (state, stage), (tokens_B, logprobs_B, active_B)

    # --- prefill --------------------------------------------------------------------------

    def _prefill(
        self,
        params,
        state: SamplerState,
        tokens_RxT,
        positions_RxT,
        block_tables_RxM,
        *,
        window: int,
    ):
        """Rows are split over the data axis like slots: rows of shard d hold its slots' tables."""
        rows = Ps(self.data_axis)
        body = functools.partial(self._prefill_local, window=window)
        return self._shard_map(body, (self.param_specs, self.specs, rows, rows, rows), self.specs)(
            params, state, tokens_RxT, positions_RxT, block_tables_RxM
        )

    def _prefill_local(
        self,
        params,
        state: SamplerState,
        tokens_RxT,
        positions_RxT,
        block_tables_RxM,
        *,
        window: int,
    ):
        block_tables_RxM = self._to_local(block_tables_RxM)
        attend = attn.prefill_attend(
            state.k_pages,
            state.v_pages,
            block_tables_RxM[:, :window],
            positions_RxT,
            scale=self.scale,
        )
        _, kv = fwd.forward_hidden(
            self.model_cfg,
            params,
            tokens_RxT,
            jnp.maximum(positions_RxT, 0),
            attend,
            (),
            self._reduce,
        )
        k_new, v_new = _stack_kv(kv)
        write_RxT = positions_RxT >= 0
        return state.replace(
            k_pages=attn.write_new_kv(
                state.k_pages, k_new, block_tables_RxM, positions_RxT, write_RxT
            ),
            v_pages=attn.write_new_kv(
                state.v_pages, v_new, block_tables_RxM, positions_RxT, write_RxT
            ),
        )

    # --- page copies ----------------------------------------------------------------------

    def _copy_pages(self, state: SamplerState, src_N, dst_N):
        """src/dst: global ids, [D * n] split over the data axis (pad with null -> null)."""
        per_shard = Ps(self.data_axis)
        return self._shard_map(
            self._copy_pages_local, (self.specs, per_shard, per_shard), self.specs
        )(state, src_N, dst_N)

    def _copy_pages_local(self, state: SamplerState, src_N, dst_N):
        src_N, dst_N = self._to_local(src_N), self._to_local(dst_N)
        dst = (slice(None), dst_N)
        return state.replace(
            k_pages=attn.set_at(state.k_pages, dst, state.k_pages[:, src_N]),
            v_pages=attn.set_at(state.v_pages, dst, state.v_pages[:, src_N]),
        )


def _stack_kv(kv):
    """Per-layer (k, v) -> k [L, ...], v [L, ...]."""
    return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])


def _uniforms(rng_key, seeds_B, positions_B):
    """One uniform per row keyed by (base key, sequence seed, position of the drawn token)."""
    base = jax.random.wrap_key_data(rng_key)

    def one(seed, pos):
        key = jax.random.fold_in(jax.random.fold_in(base, seed), pos)
        return jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(one)(seeds_B, positions_B)
