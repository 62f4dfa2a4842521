"""The one table of a decoder's parameters: name, logical axes, Hugging Face name, layout.

Everything that needs to know a parameter reads it from here: the NNX module that holds the
params (decoder.py: shapes and init), checkpoint I/O (hf_io.py, gguf_io.py: HF names and the
[out, in] <-> input-major transposes), the sampler's output-major layout (block.py: which
leading dims are inputs) and every sharding, the trainer's and the sampler's tensor-parallel
split alike (logical axes through `pipelinerl_jax.sharding.RULES`).

A family (family.py, registered in registry.py) may add or drop rows; `decoder_params` is the Llama-style table that
Llama, Qwen2/3, Mistral and Gemma all share (they differ in the math, not the names).

Logical axes name every dimension of the stored array; per-layer params start with "layers"
(stacked, scanned). Weights are input-major (`x @ w` needs no transpose): the first `n_in`
dims after "layers" are the input, e.g. q_proj [L, E, H, D] with n_in = 1, o_proj [L, H, D, E]
with n_in = 2. n_in = 0: not a matmul weight (norm scale, bias, embedding table).
"""

from __future__ import annotations

import dataclasses

from pipelinerl_jax.models import lora as lora_lib
from pipelinerl_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter. `key` is its path in the params pytree ("layers/q_proj", "embed")."""

    key: str
    axes: tuple[str, ...]  # logical axis names, one per stored dim
    hf: str  # Hugging Face tensor name; "{i}" stands for the layer index
    n_in: int = 0  # leading input dims of a matmul weight (after "layers"); 0: not one
    init: str = "normal"  # "normal" (std 0.02) | "ones" | "zeros" | "lora_a" (lora.init_a)

    @property
    def name(self) -> str:
        """The last path component: "q_proj" for "layers/q_proj"."""
        return self.key.rsplit("/", 1)[-1]

    @property
    def per_layer(self) -> bool:
        return self.axes[0] == "layers"

    @property
    def layer_axes(self) -> tuple[str, ...]:
        """Logical axes of one layer's slice (the "layers" axis dropped)."""
        return self.axes[1:] if self.per_layer else self.axes


def axis_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Logical axis name -> its size for this config."""
    return {
        "layers": cfg.num_layers,
        "vocab": cfg.vocab_size,
        "embed": cfg.hidden_size,
        "norm": cfg.hidden_size,
        "q_heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "mlp": cfg.intermediate_size,
        "lora_rank": cfg.lora.rank if cfg.lora else 0,
    }


def shape_of(spec: ParamSpec, cfg: ModelConfig, *, per_layer: bool = False) -> tuple[int, ...]:
    """The stored shape (or one layer's, with per_layer=True)."""
    sizes = axis_sizes(cfg)
    axes = spec.layer_axes if per_layer else spec.axes
    return tuple(sizes[a] for a in axes)


def decoder_params(cfg: ModelConfig, *, norm_init: str = "ones") -> tuple[ParamSpec, ...]:
    """The Llama-style table. Order matters: random init draws the "normal" rows in this order.

    norm_init: "ones" for scales applied as w * x, "zeros" for Gemma's (1 + w) * x.
    """
    p = "model.layers.{i}."
    L = ("layers",)
    specs = [
        ParamSpec("embed", ("vocab", "embed"), "model.embed_tokens.weight"),
        ParamSpec("final_norm", ("norm",), "model.norm.weight", init=norm_init),
        ParamSpec("layers/attn_norm", L + ("norm",), p + "input_layernorm.weight", init=norm_init),
        ParamSpec(
            "layers/q_proj", L + ("embed", "q_heads", "head_dim"), p + "self_attn.q_proj.weight", 1
        ),
        ParamSpec(
            "layers/k_proj", L + ("embed", "kv_heads", "head_dim"), p + "self_attn.k_proj.weight", 1
        ),
        ParamSpec(
            "layers/v_proj", L + ("embed", "kv_heads", "head_dim"), p + "self_attn.v_proj.weight", 1
        ),
        ParamSpec(
            "layers/o_proj", L + ("q_heads", "head_dim", "embed"), p + "self_attn.o_proj.weight", 2
        ),
        ParamSpec(
            "layers/mlp_norm",
            L + ("norm",),
            p + "post_attention_layernorm.weight",
            init=norm_init,
        ),
        ParamSpec("layers/gate_proj", L + ("embed", "mlp"), p + "mlp.gate_proj.weight", 1),
        ParamSpec("layers/up_proj", L + ("embed", "mlp"), p + "mlp.up_proj.weight", 1),
        ParamSpec("layers/down_proj", L + ("mlp", "embed"), p + "mlp.down_proj.weight", 1),
    ]
    if cfg.attention_bias:
        specs += [
            ParamSpec("layers/q_bias", L + ("q_heads", "head_dim"), p + "self_attn.q_proj.bias"),
            ParamSpec("layers/k_bias", L + ("kv_heads", "head_dim"), p + "self_attn.k_proj.bias"),
            ParamSpec("layers/v_bias", L + ("kv_heads", "head_dim"), p + "self_attn.v_proj.bias"),
        ]
    if cfg.qk_norm:
        specs += [
            ParamSpec(
                "layers/q_norm", L + ("head_dim",), p + "self_attn.q_norm.weight", init=norm_init
            ),
            ParamSpec(
                "layers/k_norm", L + ("head_dim",), p + "self_attn.k_norm.weight", init=norm_init
            ),
        ]
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec("lm_head", ("embed", "vocab"), "lm_head.weight", 1))
    return tuple(specs)


def lora_params(lora: lora_lib.LoraConfig, base_specs) -> tuple[ParamSpec, ...]:
    """The adapter rows (models/lora.py) for a family's table, two per target projection: A
    with the projection's input axes then the rank, B with the rank then its output axes. Their
    HF names are PEFT's (with the "base_model.model." prefix a PEFT file adds left out)."""
    by_name = {s.name: s for s in base_specs if s.per_layer}
    rows = []
    for target in lora.targets:
        base = by_name[target]
        ins, outs = base.layer_axes[: base.n_in], base.layer_axes[base.n_in :]
        module = base.hf.removesuffix(".weight")
        rows += [
            ParamSpec(
                f"layers/{target}{lora_lib.SUFFIX_A}",
                ("layers", *ins, lora_lib.RANK_AXIS),
                f"{module}.lora_A.weight",
                base.n_in,
                init="lora_a",
            ),
            ParamSpec(
                f"layers/{target}{lora_lib.SUFFIX_B}",
                ("layers", lora_lib.RANK_AXIS, *outs),
                f"{module}.lora_B.weight",
                1,
                init="zeros",
            ),
        ]
    return tuple(rows)


def tp_dim(spec: ParamSpec, tp_axes: frozenset[str], *, output_major: bool) -> int | None:
    """Which dim of one layer's array a tensor-parallel mesh axis splits, or None.

    tp_axes: the logical axes the sharding rules map to the tp mesh axis (heads, mlp, vocab).
    Input-major (as stored): the position of the first such axis. Output-major (the sampler's
    [O, I] matrices of a matmul weight): 0 when it is an output axis (q/k/v/gate/up: split by
    output heads or columns, Megatron's column split), 1 when it is an input axis (o_proj and
    down: the row split whose partial products are summed).
    """
    axes = spec.layer_axes
    hits = [i for i, a in enumerate(axes) if a in tp_axes]
    if not hits:
        return None
    if output_major and spec.n_in:
        return 1 if hits[0] < spec.n_in else 0
    return hits[0]  # biases keep their stored axes in both layouts
