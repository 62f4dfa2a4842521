"""The sampler's device steps over SamplerState, as free jittable functions: what a researcher
composes with their own code. sampler/engine.py compiles them once per (model, shapes, mesh)
under shard_map for the PagedSampler.

Free functions (cfg: the ModelConfig, ecfg: the EngineConfig; both hashable, pass them as jit
statics or bind them with functools.partial):

  prepare_params(params, *, cfg, ecfg) -> params
      model params -> the per-layer view the engine runs on (forward.decode_params, in the
      activation layout of the decode strategy `ecfg.attention` picks; strategies.py).
  empty_state(cfg, ecfg, *, chunk_steps, seed) -> state
      zeroed pool, every slot empty (state.init_state with the engine's sizes).
  state_from_prompts(params, prompts, *, cfg, ecfg, ...) -> state
      prompt b in slot b, its pages assigned and its K/V prefilled: ready for decode_chunk.
  decode_chunk(params, state, version, *, cfg, ecfg, k, window, apply=None) -> state
      k decode steps in one lax.scan. Params are an ordinary argument: any params pytree with
      the same shapes/dtypes/shardings reuses the compiled executable, so a weight swap between
      chunks never recompiles. `version` is a traced int32 scalar stamped on every token of
      the chunk. Results: state.out_tokens / out_logprobs / out_versions / out_valid [B, k].
  prefill(params, state, tokens, positions, block_tables, *, cfg, ecfg, window) -> state
      writes K/V of one chunk of prompt tokens per row into the rows' pages (no logits: the
      first new token is sampled by the decode step that consumes the last prompt token).
  copy_pages(state, src, dst, *, ecfg) -> state
      copies pages (all layers): a group's attempts each get a private copy of the prompt's
      partially filled last page.

Their statics (EngineConfig, MeshAxes, pick_window, ModelApply) live in statics.py and are
importable from here too.

`apply=` (decode_chunk, prefill, state_from_prompts) decodes a model of your own over the same
paged cache: see ModelApply below.

    params = steps.prepare_params(model_params, cfg=cfg, ecfg=ecfg)
    state = steps.state_from_prompts(params, prompts, cfg=cfg, ecfg=ecfg, chunk_steps=8)
    decode = jax.jit(functools.partial(steps.decode_chunk, cfg=cfg, ecfg=ecfg, k=8, window=4))
    state = decode(params, state, 0)          # state.out_tokens: [B, 8]

Conventions of a decodable state (state.py documents each field): slot b's sequence has
`lengths[b]` tokens, K/V cached in its pages for positions < lengths - 1, and `last_token[b]`
(the token at lengths - 1) is the next step's input; `block_tables[b, m]` is the page holding
positions [m * S, (m + 1) * S), 0 (the null page) where none; it decodes while `active[b]`
until `lengths` reaches `limit` or it samples one of `stop_tokens[b]`.

`window` (static) is how many leading block-table pages attention reads per row; the host
picks it from a small set of buckets (`pick_window`) so reads scale with the longest live
sequence, not with max_seq_len, at a handful of compiles. It must cover every active row's
pages after the chunk.

Dimension letters (pipelinerl_jax/__init__.py):
B slots, R prefill rows, T prefill tokens, C chunk steps, V vocabulary,
L layers, M pages per slot, W window pages, P pages, S page size, X stop tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.sampler import attend as attn
from pipelinerl_jax.sampler import forward as fwd
from pipelinerl_jax.sampler import sampling
from pipelinerl_jax.sampler.config import ATTENTION_IMPLS
from pipelinerl_jax.sampler.state import SLOT_FIELDS, SamplerState, init_state
from pipelinerl_jax.sampler.statics import (
    ONE_DEVICE,
    EngineConfig,
    MeshAxes,
    ModelApply,
    pick_window,
    pool_dtype,
    strategy_of,
    window_buckets,
)

__all__ = [
    "ATTENTION_IMPLS",
    "EngineConfig",
    "MeshAxes",
    "ModelApply",
    "copy_pages",
    "decode_chunk",
    "empty_state",
    "pick_window",
    "pool_dtype",
    "pool_values",
    "prefill",
    "prepare_params",
    "state_from_prompts",
    "window_buckets",
]


# --- free functions ---------------------------------------------------------------------------


def pool_values(state: SamplerState, ecfg: EngineConfig):
    """(keys, values) of the page pool as cache_dtype arrays, however the engine stores them."""
    return tuple(attn.float_view(p, ecfg.cache_dtype) for p in (state.k_pages, state.v_pages))


def _to_local(page_ids, state: SamplerState, axes: MeshAxes):
    """Global page ids -> ids inside this device's range of the pool (its local pages)."""
    if axes.data is None:
        return page_ids
    return page_ids - jax.lax.axis_index(axes.data) * state.k_pages.shape[1]


def _reduce(axes: MeshAxes):
    return (lambda x: jax.lax.psum(x, axes.tp)) if axes.tp else None


def _check_apply(apply, axes: MeshAxes) -> None:
    if apply is not None and axes.tp is not None:
        raise ValueError(
            "decode_chunk(apply=...): your model runs unsplit; tensor parallelism needs the "
            "built-in families (leave apply out, or use a mesh without a tp axis)"
        )


def scale_of(cfg) -> float:
    return 1.0 / math.sqrt(cfg.head_dim)


def prepare_params(params, *, cfg, ecfg: EngineConfig):
    """Model params -> the engine's view of them (forward.decode_params in the decode
    strategy's layout); run it once per params version, off the chunk boundary."""
    return fwd.decode_params(
        cfg, params, layout=strategy_of(ecfg).layout, head_dtype=ecfg.head_dtype
    )


def decode_chunk(
    params,
    state: SamplerState,
    version,
    *,
    cfg,
    ecfg: EngineConfig,
    k: int,
    window: int,
    axes: MeshAxes = ONE_DEVICE,
    apply: ModelApply | None = None,
    width: int | None = None,
) -> SamplerState:
    """k decode steps of every active slot (see the module docstring); params from
    `prepare_params` (or your model's own, with `apply`), state e.g. from
    `state_from_prompts`. Jittable with cfg, ecfg, k, window, axes, apply and width static;
    donate the state to update the pool in place.

    width: run only the first `width` slots (of this device's share under shard_map); the
    others must be inactive: they keep their fields and come out with no valid tokens. A
    step's cost grows with the rows it runs, so a scheduler that packs its running
    sequences low (Scheduler.compact) decodes a half-empty batch at a narrower width."""
    _check_apply(apply, axes)
    if width is not None and width < state.active.shape[0]:
        return _decode_first(
            params,
            state,
            version,
            width,
            cfg=cfg,
            ecfg=ecfg,
            k=k,
            window=window,
            axes=axes,
            apply=apply,
        )
    strategy = strategy_of(ecfg)
    block_tables_BxM = _to_local(state.block_tables, state, axes)
    carry = strategy.init_carry(state, block_tables_BxM, window)
    # The strategy's carry owns the pool while the chunk runs: carried once, not twice.
    slots = state.replace(k_pages=None, v_pages=None)
    step = functools.partial(
        _decode_step,
        params,
        block_tables_BxM,
        cfg=cfg,
        ecfg=ecfg,
        strategy=strategy,
        window=window,
        axes=axes,
        apply=apply,
    )
    (slots, carry), (tokens_CxB, logprobs_CxB, valid_CxB) = jax.lax.scan(
        step, (slots, carry), None, length=k
    )
    state = strategy.finish(slots, carry)
    version = jnp.asarray(version, jnp.int32)
    return state.replace(
        out_tokens=tokens_CxB.T,
        out_logprobs=logprobs_CxB.T,
        out_valid=valid_CxB.T,
        out_versions=jnp.where(valid_CxB.T, version, -1),
    )


# What a row past the decoded width holds in each out_* field: nothing sampled.
_OUT_FILL = {"out_tokens": 0, "out_logprobs": 0.0, "out_versions": -1, "out_valid": False}


def _decode_first(params, state: SamplerState, version, width: int, **statics) -> SamplerState:
    """decode_chunk on slots [0, width) alone, the other rows' fields put back unchanged."""
    rows = list(SLOT_FIELDS)
    narrow = decode_chunk(
        params, state.replace(**{n: getattr(state, n)[:width] for n in rows}), version, **statics
    )
    b = state.active.shape[0]
    kept = {n: jnp.concatenate([getattr(narrow, n), getattr(state, n)[width:]]) for n in rows}
    empty = {
        n: jnp.concatenate(
            [
                getattr(narrow, n),
                jnp.full((b - width, statics["k"]), fill, getattr(narrow, n).dtype),
            ]
        )
        for n, fill in _OUT_FILL.items()
    }
    return narrow.replace(**kept, **empty)


def _decode_step(params, block_tables_BxM, loop, _, *, cfg, ecfg, strategy, window, axes, apply):
    """One token per slot: forward with the strategy's attend, sample, advance the slots."""
    slots, carry = loop
    positions_B = slots.lengths - 1
    active_B = slots.active
    attend = strategy.attend(block_tables_BxM, positions_B, active_B, window, scale_of(cfg))
    if apply is not None:
        logits_Bx1xV, carry = apply(
            params, slots.last_token[:, None], positions_B[:, None], attend, carry
        )
        logits_VxB = logits_Bx1xV[:, 0].T.astype(jnp.float32)
    else:
        hidden_Bx1xE, carry = fwd.forward_hidden(
            cfg,
            params,
            slots.last_token[:, None],
            positions_B[:, None],
            attend,
            carry,
            _reduce(axes),
            layout=strategy.layout,
        )
        gather_axis = axes.tp if axes.gather_logits else None
        logits_VxB = fwd.logits_vocab_major(params, hidden_Bx1xE[:, 0].T, gather_axis)
    u_B = _uniforms(slots.rng_key, slots.seeds, slots.lengths)
    tokens_B, logprobs_B = sampling.sample_vocab_major(
        logits_VxB,
        slots.temperature,
        slots.top_k,
        slots.top_p,
        u_B,
        truncated=ecfg.truncated_logprobs,
    )
    lengths_B = slots.lengths + active_B.astype(jnp.int32)
    stopped_B = jnp.any(slots.stop_tokens == tokens_B[:, None], axis=-1)
    done_B = active_B & (stopped_B | (lengths_B >= slots.limit))
    slots = slots.replace(
        last_token=jnp.where(active_B, tokens_B, slots.last_token),
        lengths=lengths_B,
        active=active_B & ~done_B,
    )
    return (slots, carry), (tokens_B, logprobs_B, active_B)


def prefill(
    params,
    state: SamplerState,
    tokens_RxT,
    positions_RxT,
    block_tables_RxM,
    *,
    cfg,
    ecfg: EngineConfig,
    window: int,
    axes: MeshAxes = ONE_DEVICE,
    apply: ModelApply | None = None,
) -> SamplerState:
    """K/V of T prompt tokens per row into the rows' pages. positions_RxT: the tokens'
    positions, -1 for padding (at the end of a row; it writes to the null page); a row sees
    its cached positions before the chunk start in its first `window` pages (0 for a first
    chunk). Rows are independent of slots: block_tables_RxM names each row's pages."""
    _check_apply(apply, axes)
    strategy = strategy_of(ecfg)
    block_tables_RxM = _to_local(block_tables_RxM, state, axes)
    attend = attn.prefill_attend(
        block_tables_RxM,
        window,
        positions_RxT,
        scale=scale_of(cfg),
        scatter=strategy.scatter,
        cache_dtype=ecfg.cache_dtype,
    )
    pool = (state.k_pages, state.v_pages)
    if apply is not None:
        _, (k_pages, v_pages) = apply(
            params, tokens_RxT, jnp.maximum(positions_RxT, 0), attend, pool
        )
        return state.replace(k_pages=k_pages, v_pages=v_pages)
    _, (k_pages, v_pages) = fwd.forward_hidden(
        cfg,
        params,
        tokens_RxT,
        jnp.maximum(positions_RxT, 0),
        attend,
        pool,
        _reduce(axes),
        layout=strategy.layout,
    )
    return state.replace(k_pages=k_pages, v_pages=v_pages)


def copy_pages(
    state: SamplerState, src_ids, dst_ids, *, ecfg: EngineConfig, axes: MeshAxes = ONE_DEVICE
) -> SamplerState:
    """Page src_ids[i] -> dst_ids[i], all layers (global ids; null -> null pads)."""
    scatter = strategy_of(ecfg).scatter
    src_ids, dst_ids = _to_local(src_ids, state, axes), _to_local(dst_ids, state, axes)
    dst = (slice(None), dst_ids)
    return state.replace(
        k_pages=scatter(state.k_pages, dst, state.k_pages[:, src_ids]),
        v_pages=scatter(state.v_pages, dst, state.v_pages[:, src_ids]),
    )


def empty_state(
    cfg, ecfg: EngineConfig, *, chunk_steps: int, seed: int = 0, shardings=None
) -> SamplerState:
    """A fresh state of the engine's sizes: zeroed pool, every slot empty."""
    return init_state(
        num_layers=cfg.num_layers,
        num_pages=ecfg.num_pages,
        page_size=ecfg.page_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        pool_dtype=pool_dtype(ecfg),
        num_slots=ecfg.num_slots,
        pages_per_slot=ecfg.pages_per_slot,
        max_stop_tokens=ecfg.max_stop_tokens,
        chunk_steps=chunk_steps,
        seed=seed,
        shardings=shardings,
    )


_prefill_jit = jax.jit(
    prefill,
    static_argnames=("cfg", "ecfg", "window", "axes", "apply"),
    donate_argnames=("state",),
)


def state_from_prompts(
    params,
    prompts,
    *,
    cfg,
    ecfg: EngineConfig,
    chunk_steps: int = 16,
    max_new_tokens: int | None = None,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    stop_tokens=(),
    seed: int = 0,
    seeds=None,
    apply: ModelApply | None = None,
) -> SamplerState:
    """A state ready for `decode_chunk` (one device): prompt b in slot b, prefilled.

    params: from `prepare_params`, or your model's own with `apply` (then cfg needs only
    num_layers, num_kv_heads, head_dim and vocab_size). Slot b (b < len(prompts)) gets the next free pages after
    the null page, as many as its K/V needs up to `limit = min(len(prompt) + max_new_tokens,
    pages_per_slot * page_size)` (all its pages without max_new_tokens); its block table
    names them, 0 after. The K/V of every prompt token but the last is prefilled in one call;
    `last_token` is the prompt's last token and `lengths` its length, so the first decode step
    consumes it and samples the first new token. Slots past the prompts stay empty (inactive).
    temperature / top_k / top_p / seeds: scalars or one value per prompt (0 / 0 / 1 = greedy,
    no top-k, no top-p; seeds default to the slot index); stop_tokens: ids every prompt stops
    at (at most max_stop_tokens). chunk_steps sizes the out_* fields: decoding with another k
    works but compiles once more. Raises ValueError when the prompts do not fit.
    """
    num_slots, page_size, width = ecfg.num_slots, ecfg.page_size, ecfg.pages_per_slot
    prompts = [[int(t) for t in p] for p in prompts]
    n = len(prompts)
    if not 0 < n <= num_slots:
        raise ValueError(f"{n} prompts for num_slots={num_slots}: give 1 to {num_slots}")
    if len(stop_tokens) > ecfg.max_stop_tokens:
        raise ValueError(f"{len(stop_tokens)} stop tokens > max_stop_tokens")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    capacity = width * page_size  # positions a slot's block table can name
    tables_BxM = np.zeros((num_slots, width), np.int32)
    limit_B = np.ones(num_slots, np.int32)
    next_page = 1  # page 0 is the null page
    for b, prompt in enumerate(prompts):
        if not 0 < len(prompt) < capacity:
            raise ValueError(f"prompt {b}: {len(prompt)} tokens; a slot holds 1 to {capacity - 1}")
        if not all(0 <= t < cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt {b}: a token id outside [0, {cfg.vocab_size})")
        extra = capacity if max_new_tokens is None else max_new_tokens
        limit_B[b] = min(len(prompt) + extra, capacity)
        # K/V are written for positions < limit - 1 (the last sampled token is never fed).
        pages = -(-(int(limit_B[b]) - 1) // page_size)
        if next_page + pages > ecfg.num_pages:
            raise ValueError(
                f"prompts need more than num_pages={ecfg.num_pages} pages: raise it or "
                "lower max_new_tokens"
            )
        tables_BxM[b, :pages] = np.arange(next_page, next_page + pages)
        next_page += pages

    def per_prompt(value, dtype, fill):
        out = np.full(num_slots, fill, dtype)
        out[:n] = np.broadcast_to(np.asarray(value, dtype), (n,))
        return out

    stops_X = np.full(ecfg.max_stop_tokens, -1, np.int32)
    stops_X[: len(stop_tokens)] = stop_tokens
    slots = dict(
        block_tables=tables_BxM,
        last_token=per_prompt([p[-1] for p in prompts], np.int32, 0),
        lengths=per_prompt([len(p) for p in prompts], np.int32, 1),
        limit=limit_B,
        active=np.arange(num_slots) < n,
        temperature=per_prompt(temperature, np.float32, 0.0),
        top_k=per_prompt(top_k, np.int32, 0),
        top_p=per_prompt(top_p, np.float32, 1.0),
        stop_tokens=np.broadcast_to(stops_X, (num_slots, ecfg.max_stop_tokens)),
        seeds=per_prompt(np.arange(n) if seeds is None else seeds, np.uint32, 0),
    )
    state = empty_state(cfg, ecfg, chunk_steps=chunk_steps, seed=seed)
    state = state.replace(**{name: jnp.asarray(value) for name, value in slots.items()})
    longest = max(len(p) for p in prompts) - 1  # the last token is fed by the first decode step
    if longest == 0:
        return state
    tokens = 1 << (longest - 1).bit_length()  # a power of two: fewer compiled shapes
    tokens_RxT = np.zeros((num_slots, tokens), np.int32)
    positions_RxT = np.full((num_slots, tokens), -1, np.int32)
    for b, prompt in enumerate(prompts):
        tokens_RxT[b, : len(prompt) - 1] = prompt[:-1]
        positions_RxT[b, : len(prompt) - 1] = np.arange(len(prompt) - 1)
    return _prefill_jit(
        params,
        state,
        jnp.asarray(tokens_RxT),
        jnp.asarray(positions_RxT),
        jnp.asarray(tables_BxM),
        cfg=cfg,
        ecfg=ecfg,
        window=0,
        apply=apply,
    )


def _uniforms(rng_key, seeds_B, positions_B):
    """One uniform per row keyed by (base key, sequence seed, position of the drawn token)."""
    base = jax.random.wrap_key_data(rng_key)

    def one(seed, pos):
        key = jax.random.fold_in(jax.random.fold_in(base, seed), pos)
        return jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(one)(seeds_B, positions_B)
