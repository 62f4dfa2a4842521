"""The decoder of every family in Flax NNX: params from the family's table, a scanned forward.

The module only holds parameters; the forward is a pure function over the params pytree
(`nnx.split` once, pass `params` through jit). Per-layer params are stacked along a leading
L axis and the layers run under `lax.scan`, so compile time does not grow with depth.
Attention is a hook (`attend`) so that one forward serves packed training rows
(`segment_causal_attention`) and any cached decoding (an `attend` that reads and writes a
KV cache scanned together with the layer params). The block itself is block.py's, in its
token-major layout; which norm, activation and parameters it has is the family's
(registry.py).

Weights are stored input-major (`x @ w` needs no transpose): q_proj [E, H, D], o_proj [H, D, E].

Letters (see pipelinerl_jax/__init__.py): B batch, T time (queries), S time (keys), L layers,
V vocab, E hidden, F mlp, H query heads, K kv heads, G = H/K, D head_dim.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pipelinerl_jax.models import accumulating_scan, attention, block, lora, registry, remat, rope
from pipelinerl_jax.models import params as param_table
from pipelinerl_jax.models.block import AttentionFn
from pipelinerl_jax.models.config import ModelConfig

_INIT_STD = 0.02  # Hugging Face's default initializer_range.


def _param(value: jax.Array, names: tuple[str | None, ...]) -> nnx.Param:
    # Eager sharding off: logical names are metadata for pipelinerl_jax.sharding, not a mesh spec.
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def family_of(cfg: ModelConfig):
    """The config's `registry` family."""
    return registry.family_of(cfg.model_type)


def base_param_specs(cfg: ModelConfig) -> tuple[param_table.ParamSpec, ...]:
    """The family's parameter table for this config: what a Hugging Face checkpoint holds."""
    return family_of(cfg).param_table(cfg)


def param_specs(cfg: ModelConfig) -> tuple[param_table.ParamSpec, ...]:
    """The family's table, then the LoRA adapter rows when cfg.lora is set (models/lora.py)."""
    base = base_param_specs(cfg)
    return base + (param_table.lora_params(cfg.lora, base) if cfg.lora else ())


class Decoder(nnx.Module):
    """Parameter container built from the family's table; see `forward_hidden`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.param_dtype)
        specs = param_specs(cfg)
        shapes = {s.key: param_table.shape_of(s, cfg) for s in specs}
        normal = [s for s in specs if s.init == "normal"]
        # One normal draw sliced into every weight: each separate jax.random call costs about a
        # second of XLA compile time on CPU, which dominated test time with ~15 calls.
        sizes = [math.prod(shapes[s.key]) for s in normal]
        flat = _INIT_STD * jax.random.normal(rngs.params(), (sum(sizes),), jnp.float32)
        values, start = {}, 0
        for s, size in zip(normal, sizes):
            values[s.key] = flat[start : start + size].reshape(shapes[s.key])
            start += size
        # Adapters draw from a key of their own, so the base is the same with or without them.
        adapters = init_adapters(cfg, rngs.params())["layers"] if cfg.lora else {}
        layers = {}
        for s in specs:
            if s.init == "normal":
                value = values[s.key].astype(dtype)
            elif lora.is_adapter(s.key):
                value = adapters[s.name]
            else:
                value = jnp.full(shapes[s.key], 1.0 if s.init == "ones" else 0.0, dtype)
            if s.per_layer:
                layers[s.name] = _param(value, s.axes)
            else:
                setattr(self, s.key, _param(value, s.axes))
        self.layers = nnx.Dict(layers)


def init_adapters(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Fresh LoRA adapters {"layers": {name: [L, ...]}}, f32 whatever the param dtype (a bf16
    base keeps f32 adapters, as their optimizer state is): every A drawn as PEFT draws it
    (lora.init_a), every B zero, so the adapted model is the base model."""
    dtype = jnp.dtype(lora.ADAPTER_DTYPE)
    out = {}
    for s in param_table.lora_params(cfg.lora, base_param_specs(cfg)):
        shape = param_table.shape_of(s, cfg)
        if s.init == "lora_a":
            rng, key = jax.random.split(rng)
            out[s.name] = lora.init_a(key, shape, s.n_in).astype(dtype)
        else:
            out[s.name] = jnp.zeros(shape, dtype)
    return {"layers": out}


def init_params(cfg: ModelConfig, rng: jax.Array) -> nnx.State:
    """Random params (normal(0, 0.02) weights, unit norms); jittable, e.g. with out_shardings."""
    return nnx.split(Decoder(cfg, rngs=nnx.Rngs(params=rng)))[1]


_init_params_jit = jax.jit(init_params, static_argnums=0)


def init(cfg: ModelConfig, rng: jax.Array) -> tuple[nnx.GraphDef, nnx.State]:
    """Random init -> (graphdef, params), computed under jit (one compile per config)."""
    graphdef, _ = abstract_init(cfg)
    return graphdef, _init_params_jit(cfg, rng)


def abstract_init(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params of jax.ShapeDtypeStruct) without allocating: for shardings and loading."""
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(params=0))))


def config_of(graphdef: nnx.GraphDef) -> ModelConfig:
    """The ModelConfig stored (as a static attribute) in the graphdef."""
    for name, attr in getattr(graphdef, "attributes", ()):
        if name == "cfg" and isinstance(getattr(attr, "value", None), ModelConfig):
            return attr.value
    raise TypeError("graphdef does not come from pipelinerl_jax.models.decoder.init/load_hf")


def arrays(params) -> dict:
    """Nested dict of raw arrays from an nnx.State (or a dict already holding arrays)."""
    if isinstance(params, nnx.State):
        return nnx.to_pure_dict(params)
    return jax.tree.map(
        lambda v: v.get_value() if isinstance(v, nnx.Variable) else v,
        params,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )


def forward_hidden(
    graphdef: nnx.GraphDef,
    params,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array,
    *,
    attend: AttentionFn,
    cache=None,
    layer_grads_into=None,
) -> tuple[jax.Array, Any]:
    """Hidden states after the final norm [B, T, E] (compute dtype), and the updated cache.

    `cache` is None or a pytree whose leaves all have a leading L axis; each layer's slice is
    handed to `attend` and the returned slices are stacked into the new cache.
    layer_grads_into: None, or an accumulator shaped like params["layers"] (no cache, no
    shared base): differentiating w.r.t. it then returns it plus the layers' gradient, added
    in place, and the layers get none (models/accumulating_scan.py).
    """
    cfg = config_of(graphdef)
    family = family_of(cfg)
    p = arrays(params)
    # A LoRA trainer reading a sampler's converted base (models/shared_base.py): each layer's
    # base params are picked inside the scan, beside that layer's adapters.
    shared = p.get("shared")
    dtype = jnp.dtype(cfg.compute_dtype)
    embed_VxE = p["embed"] if shared is None else shared.embed_VxE
    x_BxTxE = block.embed(cfg, family, embed_VxE, tokens_BxT, dtype)
    inv_freq = rope.inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope.cos_sin(positions_BxT, inv_freq, dtype)
    layout = block.TOKEN_MAJOR

    def body(x, xs):
        lp, layer_cache = dict(xs[0]), xs[-1]
        if shared is not None:
            lp = {**shared.layer(xs[1]), **lp}
        lp = jax.tree.map(lambda w: w.astype(dtype), lp)
        return block.decoder_block(
            cfg, family, layout, x, lp, tokens_BxT.shape, cos, sin, attend, layer_cache, keep=keep
        )

    keep = remat.keep if cfg.remat else None  # names only what a checkpoint policy reads

    if cfg.remat:
        saved = jax.checkpoint_policies.save_only_these_names(*remat.saved_names(cfg.remat_policy))
        body = jax.checkpoint(body, prevent_cse=False, policy=saved)
    if shared is None:
        xs = (p["layers"], cache)
        final_norm = p["final_norm"]
    else:
        xs = (p["layers"], jnp.arange(cfg.num_layers), cache)
        final_norm = shared.final_norm
    if layer_grads_into is None:
        x_BxTxE, new_cache = jax.lax.scan(body, x_BxTxE, xs)
    else:
        if cache is not None or shared is not None:
            raise ValueError("forward_hidden: layer_grads_into takes no cache and no shared base")
        x_BxTxE = accumulating_scan.scan_layers(
            lambda x, lp: body(x, (lp, None))[0],
            x_BxTxE,
            p["layers"],
            grads_into=layer_grads_into,
        )
        new_cache = None
    return family.norm(x_BxTxE, final_norm, cfg.rms_norm_eps), new_cache


def lm_head_weight(params) -> jax.Array:
    """The output projection [E, V]: the untied head, or the embedding transposed."""
    p = arrays(params)
    if "shared" in p:
        return p["shared"].head_ExV()
    return p["lm_head"] if "lm_head" in p else p["embed"].T


def logits_from_hidden(params, hidden_BxTxE: jax.Array) -> jax.Array:
    """Logits [B, T, V] in float32 (the head always runs in f32, as in the trainer's logprobs)."""
    w_ExV = lm_head_weight(params).astype(jnp.float32)
    return jnp.einsum(
        "bte,ev->btv", hidden_BxTxE.astype(jnp.float32), w_ExV, preferred_element_type=jnp.float32
    )


def forward(
    graphdef: nnx.GraphDef,
    params,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array,
    segment_ids_BxT: jax.Array | None = None,
    prefix_ids_BxT: jax.Array | None = None,
) -> jax.Array:
    """Full-sequence logits [B, T, V] f32; packed rows when `segment_ids_BxT` is given (with
    shared prompts when `prefix_ids_BxT` is too)."""
    if segment_ids_BxT is None:
        segment_ids_BxT = jnp.zeros(tokens_BxT.shape, jnp.int32)
    attend = attention.segment_causal_attention(segment_ids_BxT, prefix_ids_BxT)
    hidden_BxTxE, _ = forward_hidden(graphdef, params, tokens_BxT, positions_BxT, attend=attend)
    return logits_from_hidden(params, hidden_BxTxE)


@functools.partial(jax.jit, static_argnums=0)
def jit_forward(
    graphdef, params, tokens_BxT, positions_BxT, segment_ids_BxT=None, prefix_ids_BxT=None
):
    """`forward` under jit (graphdef static)."""
    return forward(graphdef, params, tokens_BxT, positions_BxT, segment_ids_BxT, prefix_ids_BxT)
