"""The sampler's own view of the params (one array per layer) and an unrolled forward over it.

Why not `llama.forward_hidden` (a `lax.scan` over params stacked [L, ...]): inside the scan,
XLA:CPU materialises each layer's weight slice (a `dynamic-slice` fusion) before the matmul,
so every decode step copies all layer weights once more: 3x the weight memory traffic of a
step that is memory-bound at small batch. Measured on the bench model (57.9M params): the
layer stack at batch 1 took 18 ms CPU scanned vs 8 ms unrolled over separate arrays (batch 8:
45 vs 28 ms). The sampler therefore unstacks the params once per version (`decode_params`,
at `set_params` time, off the chunk boundary), casts them to the compute dtype once, keeps
the LM head as an f32 [E, V] array, and runs the layers unrolled. The layer math itself is
the model's (`llama._layer`), so the two forwards cannot drift apart.

Dimension letters: B batch, T tokens, E hidden, V vocabulary, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipelinerl_jax.models import llama, rope
from pipelinerl_jax.models.config import ModelConfig


def decode_params(cfg: ModelConfig, params) -> dict:
    """Stacked model params -> {embed, layers: (per-layer dict, ...), final_norm, head_ExV}."""
    p = llama.arrays(params)
    dtype = jnp.dtype(cfg.compute_dtype)
    layers = tuple({name: w[i].astype(dtype) for name, w in p["layers"].items()}
                   for i in range(cfg.num_layers))
    return {"embed": p["embed"].astype(dtype), "layers": layers,
            "final_norm": p["final_norm"],
            "head_ExV": llama.lm_head_weight(params).astype(jnp.float32)}


def forward_hidden(cfg: ModelConfig, dparams: dict, tokens_BxT, positions_BxT, attend, carry):
    """Hidden states after the final norm, and attend's carry after the last layer.

    attend(q, k, v, (layer, carry)) -> (out, (layer, carry)) gets the layer index as a Python
    int; the carry threads through the layers in order (collected K/V, or the page pool).
    """
    dtype = jnp.dtype(cfg.compute_dtype)
    x_BxTxE = jnp.take(dparams["embed"], tokens_BxT, axis=0)
    inv_freq = rope.inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope.cos_sin(positions_BxT, inv_freq, dtype)
    for layer, lp in enumerate(dparams["layers"]):
        x_BxTxE, (_, carry) = llama._layer(cfg, x_BxTxE, lp, cos, sin, attend, (layer, carry))
    return llama.rms_norm(x_BxTxE, dparams["final_norm"], cfg.rms_norm_eps), carry


def logits(dparams: dict, hidden_BxTxE):
    """f32 logits [B, T, V] (the head runs in f32, as the trainer's logprobs do)."""
    return jnp.einsum("bte,ev->btv", hidden_BxTxE.astype(jnp.float32), dparams["head_ExV"],
                      preferred_element_type=jnp.float32)
