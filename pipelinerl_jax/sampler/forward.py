"""The sampler's view of the params (one array per layer) and an unrolled forward over it.

Why not `decoder.forward_hidden` (a `lax.scan` over params stacked [L, ...]): inside the scan,
XLA:CPU materialises each layer's weight slice (a `dynamic-slice` fusion) before the matmul,
so every decode step copies all layer weights once more: 3x the weight memory traffic of a
step that is memory-bound at small batch (docs/cpu_measurements.md#unrolled-decode-layers).
The sampler therefore converts the params once per version (`decode_params`,
at `set_params` time or in the publisher's thread, off the chunk boundary): unstacked, cast to
the compute dtype once, laid out for the block's `layout` (models/block.py: "feature_major",
the CPU layout, transposes every projection to output-major; "token_major", plain JAX, keeps
them as stored), the LM head kept as a [V, E] array (f32 unless head_dtype says otherwise);
the layers run unrolled through the model's own `block.decoder_block`, so the math is the model's.

Tensor parallelism (Megatron-style, inside the engine's shard_map): `decode_param_specs` splits
every weight along the dimension its logical axis maps to the tp mesh axis (models/params.py
`tp_dim`: q/k/v, their biases, gate and up by output heads / columns, o_proj and down by input
columns), and the LM head by vocabulary; the forward psums the two partial outputs per layer
(`reduce`) and all-gathers the logits, so every device of a tp group holds the same hidden
state and samples the same token. The KV pool is split by kv heads to match.

Letters (see pipelinerl_jax/__init__.py): B batch, T tokens, N = B * T, E hidden,
V vocabulary, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as Ps

from pipelinerl_jax import sharding
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import block, decoder, lora, rope
from pipelinerl_jax.models import params as param_table
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.models.mixed_matmul import HEAD_DTYPES

LAYOUTS = block.LAYOUTS


def _layout(layout: str, batch_shape=None):
    if layout == "token_major":
        return block.TOKEN_MAJOR
    if layout == "feature_major":
        return block.FeatureMajor(batch_shape)
    raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")


def decode_params(
    cfg: ModelConfig, params, layout: str = "feature_major", head_dtype: str = "float32"
) -> dict:
    """Stacked model params -> {embed, layers: (per-layer dict, ...), final_norm, head_VxE};
    each layer as the layout's `prepare` lays it out, the head vocabulary-major in
    `head_dtype` (see `logits_vocab_major`).

    A 16-bit embedding table is kept as its uint16 bit patterns (block.embed views the
    gathered rows back): XLA:CPU gathers 16-bit floats by converting the whole table to f32
    first, on SmolLM2 a 113 MB conversion in every decode chunk; integers it gathers in place.
    """
    if head_dtype not in HEAD_DTYPES:
        raise ConfigError(f"sampler head_dtype={head_dtype!r}: use one of {HEAD_DTYPES}")
    p = decoder.arrays(params)
    dtype = jnp.dtype(cfg.compute_dtype)
    embed_VxE = p["embed"].astype(dtype)
    if dtype.itemsize == 2:
        embed_VxE = jax.lax.bitcast_convert_type(embed_VxE, jnp.uint16)
    n_in = block.matmul_inputs(decoder.param_specs(cfg))
    lay = _layout(layout)
    layers = tuple(
        lay.prepare({name: w[i] for name, w in p["layers"].items()}, n_in, dtype)
        for i in range(cfg.num_layers)
    )
    return {
        "embed": embed_VxE,
        "layers": layers,
        "final_norm": p["final_norm"],
        "head_VxE": decoder.lm_head_weight(params).astype(head_dtype).T,
    }


def one_tied_table(cfg: ModelConfig, view: dict) -> dict:
    """A tied model's view whose head is its embedding table, one array for both.

    With tied embeddings the [V, E] head is the embedding table itself; when both sit in one
    dtype (the f32 CPU run) and are placed alike, `decode_params`' two equal outputs are one
    copy too many (113 MB for SmolLM2), so the head is made the table."""
    embed, head = view["embed"], view["head_VxE"]
    if cfg.tie_word_embeddings and embed.dtype == head.dtype and embed.sharding == head.sharding:
        return {**view, "head_VxE": embed}
    return view


def decode_adapters(cfg: ModelConfig, adapters, layout: str = "feature_major") -> tuple:
    """LoRA adapters (models/lora.split's subtree, stacked [L, ...]) -> one dict per layer, laid
    out and cast as `decode_params` lays out the layer they join (`with_adapters`)."""
    p = decoder.arrays(adapters)
    n_in = block.matmul_inputs(decoder.param_specs(cfg))
    lay, dtype = _layout(layout), jnp.dtype(cfg.compute_dtype)
    return tuple(
        lay.prepare({name: w[i] for name, w in p["layers"].items()}, n_in, dtype)
        for i in range(cfg.num_layers)
    )


def with_adapters(view: dict, adapter_layers: tuple) -> dict:
    """A base model's `decode_params` view with each layer's adapters joined to it (no copy)."""
    layers = tuple({**b, **a} for b, a in zip(view["layers"], adapter_layers))
    return {**view, "layers": layers}


def split_view(view: dict) -> tuple[dict, tuple]:
    """The inverse of `with_adapters`: (the base view, the adapter layers)."""
    base = tuple({k: v for k, v in lp.items() if not lora.is_adapter(k)} for lp in view["layers"])
    adapters = tuple({k: v for k, v in lp.items() if lora.is_adapter(k)} for lp in view["layers"])
    return {**view, "layers": base}, adapters


def publish_dtypes(cfg: ModelConfig, params, head_dtype: str = "float32") -> dict | None:
    """{top-level param name: the dtype `decode_params` reads it in}, for the names it only
    ever reads narrower than they are stored; None when there are none.

    A publish copies these already narrowed (`narrow_for_decode`), so the trainer-to-sampler
    copy moves bf16, not the f32 master params (half the bytes). Exact: decode_params casts
    them to the same dtype anyway. The rule is `narrowed_dtypes`'."""
    stored = {
        name: {jnp.dtype(x.dtype) for x in jax.tree.leaves(tree)}
        for name, tree in decoder.arrays(params).items()
    }
    return narrowed_dtypes(cfg, stored, head_dtype)


def narrowed_dtypes(cfg: ModelConfig, stored: dict, head_dtype: str = "float32") -> dict | None:
    """publish_dtypes from the dtypes alone ({top-level name: its leaves' dtypes}), as the
    memory estimate needs them before any param exists. Layers (norms included) and the
    embedding are read in the compute dtype, the untied head in head_dtype; a tied table
    serves both, so it is narrowed only when they agree; final_norm is read as stored."""
    compute, head = jnp.dtype(cfg.compute_dtype), jnp.dtype(head_dtype)
    wanted = {"layers": compute, "lm_head": head}
    if not cfg.tie_word_embeddings or compute == head:
        wanted["embed"] = compute
    out = {
        name: dtype.name
        for name, dtype in wanted.items()
        if name in stored and all(jnp.dtype(d).itemsize > dtype.itemsize for d in stored[name])
    }
    return out or None


def narrow_for_decode(params, dtypes: dict):
    """params (same structure) with each top-level name in `dtypes` cast to its dtype."""

    def cast(path, x):
        dtype = dtypes.get(getattr(path[0], "key", None))
        return x.astype(dtype) if dtype is not None else x

    return jax.tree_util.tree_map_with_path(cast, params)


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raises ConfigError naming the dimension that does not split over `tp` devices."""
    for name, size in (
        ("num_heads", cfg.num_heads),
        ("num_kv_heads", cfg.num_kv_heads),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if size % tp:
            raise ConfigError(
                f"sampler tensor parallelism over {tp} devices needs {name}="
                f"{size} to divide by {tp}: lower the sampler's tp degree"
            )


def head_is_split(cfg: ModelConfig, tp: int) -> bool:
    """The LM head is split by vocabulary when it divides (else replicated)."""
    return tp > 1 and cfg.vocab_size % tp == 0


def decode_param_specs(
    cfg: ModelConfig, dparams, tp_axis: str | None, tp: int, layout: str = "feature_major"
):
    """PartitionSpecs for a `decode_params` pytree (all P() without tensor parallelism)."""
    tp_logical = frozenset(name for name, mesh_axis in sharding.RULES if mesh_axis == sharding.TP)
    specs = {s.name: s for s in decoder.param_specs(cfg) if s.per_layer}

    def layer_spec(name):
        dim = None
        if tp_axis:
            output_major = layout == "feature_major"
            dim = param_table.tp_dim(specs[name], tp_logical, output_major=output_major)
        return Ps() if dim is None else Ps(*([None] * dim + [tp_axis]))

    layers = tuple({name: layer_spec(name) for name in lp} for lp in dparams["layers"])
    head = Ps(tp_axis, None) if tp_axis and head_is_split(cfg, tp) else Ps()
    return {"embed": Ps(), "layers": layers, "final_norm": Ps(), "head_VxE": head}


def forward_hidden(
    cfg: ModelConfig,
    dparams: dict,
    tokens_BxT,
    positions_BxT,
    attend,
    carry,
    reduce=None,
    layout: str = "feature_major",
):
    """Hidden states [B, T, E] after the final norm, and attend's carry after the last layer.

    attend(q, k, v, (layer, carry)) -> (out, (layer, carry)) gets the layer index as a Python
    int; the carry threads through the layers in order (collected K/V, or the page pool).
    `reduce`: the tp all-reduce of the partial o_proj / down outputs (see the module docstring).
    `layout`: the one `decode_params` used.
    """
    family = decoder.family_of(cfg)
    dtype = jnp.dtype(cfg.compute_dtype)
    batch_shape = tokens_BxT.shape
    lay = _layout(layout, batch_shape)
    x = block.embed(cfg, family, dparams["embed"], tokens_BxT, dtype)
    if layout == "feature_major":
        x = x.reshape(-1, x.shape[-1]).T  # [E, N]
    inv_freq = rope.inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope.cos_sin(positions_BxT, inv_freq, dtype)
    for index, lp in enumerate(dparams["layers"]):
        x, (_, carry) = block.decoder_block(
            cfg, family, lay, x, lp, batch_shape, cos, sin, attend, (index, carry), reduce
        )
    hidden = family.norm(x, dparams["final_norm"], cfg.rms_norm_eps, lay.feature_axis)
    return lay.tokens(hidden), carry


def logits_vocab_major(dparams: dict, hidden_ExN, gather_axis: str | None = None):
    """f32 logits [V, N], as they leave the matmul: decode samples from them without a
    transpose. The head runs in its dtype (decode_params' head_dtype, f32 by default, as the
    trainer's logprobs with the same loss.head_dtype): 16-bit operands accumulate in f32.

    gather_axis: the tp axis when the head is split by vocabulary (each device computes its
    V / tp rows, then all of them are gathered).

    Vocabulary-major, as the feature-major projections (models/block.py): [V, E] @ [E, N] gives YNNPACK
    32000 rows to split over both cores, where [N, E] @ [E, V] at decode batch sizes did not
    (docs/cpu_measurements.md#vocabulary-major-head), and the sampler reduces over V without transposing [V, N] (sampling.py)."""
    out_VxN = block.output_major_matmul(dparams["head_VxE"], hidden_ExN)
    if gather_axis is not None:
        out_VxN = jax.lax.all_gather(out_VxN, gather_axis, axis=0, tiled=True)
    return out_VxN
