"""SamplerState: everything the jitted decode chunk reads and writes, as one pytree.

The host (scheduler) owns the slot table and mirrors the small per-slot fields in numpy; it
uploads them between chunks when it admits, retires or preempts. The device owns the KV pages
and advances lengths / last tokens / active flags inside a chunk. The whole state is donated
to every jitted engine call, so the page pool is updated in place. Inside a decode chunk's
scan the pool lives in the attention strategy's carry and k_pages / v_pages are None
(strategies.py). Without a scheduler, `steps.state_from_prompts` builds a decodable state.

Dimension letters (pipelinerl_jax/__init__.py):
B slots, M pages per slot (block-table width), L layers, P pages in the
pool, S tokens per page, K kv heads, D head dim, X stop tokens per slot, C steps per chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pipelinerl_jax import sharding

# Per-slot fields the host mirrors and uploads (name -> numpy dtype); see SamplerState.
SLOT_FIELDS = {
    "block_tables": np.int32,
    "last_token": np.int32,
    "lengths": np.int32,
    "limit": np.int32,
    "active": np.bool_,
    "temperature": np.float32,
    "top_k": np.int32,
    "top_p": np.float32,
    "stop_tokens": np.int32,
    "seeds": np.uint32,
}


@struct.dataclass
class SamplerState:
    """Device state of the sampler (a registered pytree; all fields are arrays)."""

    # Pool dtype (steps.pool_dtype): the cache dtype, or a 16-bit cache's uint16 bits on CPU.
    k_pages: jax.Array  # [L, P, K, S, D]: keys; page 0 is the null page
    v_pages: jax.Array  # [L, P, K, S, D]: values
    block_tables: jax.Array  # [B, M] int32: page of each slot's m-th S-token block (0 = none)
    last_token: jax.Array  # [B] int32: token at position lengths-1, input of the next step
    lengths: jax.Array  # [B] int32: tokens in the sequence; K/V cached for lengths-1
    limit: jax.Array  # [B] int32: the sequence ends when lengths reaches this
    active: jax.Array  # [B] bool: slot is decoding (False: empty or finished)
    temperature: jax.Array  # [B] f32: 0 = greedy
    top_k: jax.Array  # [B] int32: 0 = off
    top_p: jax.Array  # [B] f32: 1 = off
    stop_tokens: jax.Array  # [B, X] int32: EOS and stop ids, -1 padded
    seeds: jax.Array  # [B] uint32: per-sequence sampling seed
    rng_key: jax.Array  # [2] uint32: base key data; the draw for a token is keyed by
    #   (rng_key, seed, position), so it never depends on the slot,
    #   the chunking or preemption
    out_tokens: jax.Array  # [B, C] int32: tokens sampled in the last chunk
    out_logprobs: jax.Array  # [B, C] f32: their behaviour logprobs
    out_versions: jax.Array  # [B, C] int32: policy version that produced each token
    out_valid: jax.Array  # [B, C] bool: the slot was active at that step


def init_state(
    *,
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    pool_dtype,
    num_slots: int,
    pages_per_slot: int,
    max_stop_tokens: int,
    chunk_steps: int,
    seed: int,
    shardings: SamplerState | None = None,
) -> SamplerState:
    """A fresh state: zeroed pages (finite garbage only), all slots empty."""
    page_shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
    b, c = num_slots, chunk_steps
    host = dict(
        k_pages=None,
        v_pages=None,
        block_tables=np.zeros((b, pages_per_slot), np.int32),
        last_token=np.zeros((b,), np.int32),
        lengths=np.ones((b,), np.int32),
        limit=np.ones((b,), np.int32),
        active=np.zeros((b,), np.bool_),
        temperature=np.zeros((b,), np.float32),
        top_k=np.zeros((b,), np.int32),
        top_p=np.ones((b,), np.float32),
        stop_tokens=np.full((b, max_stop_tokens), -1, np.int32),
        seeds=np.zeros((b,), np.uint32),
        rng_key=jax.random.key_data(jax.random.key(seed)),  # uint32; traceable (eval_shape)
        out_tokens=np.zeros((b, c), np.int32),
        out_logprobs=np.zeros((b, c), np.float32),
        out_versions=np.full((b, c), -1, np.int32),
        out_valid=np.zeros((b, c), np.bool_),
    )

    def put(name, value):
        sharding = getattr(shardings, name) if shardings is not None else None
        return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)

    fields = {name: put(name, v) for name, v in host.items() if v is not None}
    for name in ("k_pages", "v_pages"):
        sharding = getattr(shardings, name) if shardings is not None else None
        fields[name] = jax.jit(lambda: jnp.zeros(page_shape, pool_dtype), out_shardings=sharding)()
    return SamplerState(**fields)


def state_shardings(mesh, data_axis: str | None, tp_axis: str | None = None) -> SamplerState:
    """NamedShardings from the project's one rules table (`sharding.RULES`, its FSDP and TP
    mesh axes renamed to the sampler's data and tp axes): slots and pool pages are "batch"
    (data-parallel, split along B and P), the pool's K axis is "kv_heads" (split over tp with
    tensor parallelism), everything else replicated. The engine checks divisibility."""
    from jax.sharding import NamedSharding

    rules = sharding.renamed(sharding.RULES, {sharding.FSDP: data_axis, sharding.TP: tp_axis})

    def spec(*names):
        return NamedSharding(mesh, sharding.logical_to_spec(names, None, mesh, rules))

    per_slot = spec("batch")
    pages = spec("layers", "batch", "kv_heads", None, "head_dim")  # [L, P, K, S, D]
    return SamplerState(
        k_pages=pages,
        v_pages=pages,
        block_tables=per_slot,
        last_token=per_slot,
        lengths=per_slot,
        limit=per_slot,
        active=per_slot,
        temperature=per_slot,
        top_k=per_slot,
        top_p=per_slot,
        stop_tokens=per_slot,
        seeds=per_slot,
        rng_key=spec(),
        out_tokens=per_slot,
        out_logprobs=per_slot,
        out_versions=per_slot,
        out_valid=per_slot,
    )
