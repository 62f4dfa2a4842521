"""What a rematerialised layer keeps for its backward pass, and how it keeps it.

With `ModelConfig.remat` each decoder layer runs under `jax.checkpoint`, and a policy names the
activations saved from the forward pass; everything else the backward needs is recomputed from
the layer's input. Two policies (`ModelConfig.remat_policy`):

- "attention": the attention output and its log-sum-exp (the blocked attention's VJP needs
  nothing else it cannot recompute), so the backward runs the layer's projections again. The
  least memory: E + H D values and H f32 a token a layer.
- "matmuls": also the outputs of q, k, v (before bias, qk-norm and RoPE), the residual after
  attention and the MLP's gate and up: every value a matmul's or a norm's backward reads, so
  the backward recomputes only elementwise work and runs no matmul twice. H D + 2 K D + E + 2 F
  more values a token a layer.

Why 16-bit activations are kept as their bit patterns on CPU: the layer scan stacks each saved
value into an [L, ...] buffer with a dynamic-update-slice, and XLA:CPU has no bf16
dynamic-update-slice: it converted the whole stacked buffer to f32 and back in every layer
(docs/cpu_measurements.md#16-bit-remat-buffers). Integer updates are done in place. Other backends keep the values as they are.

Letters (pipelinerl_jax/__init__.py): E hidden, F MLP, H q heads, K kv heads, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pipelinerl_jax.kernels import target

ATTENTION_SAVED = ("attention_out", "attention_lse")
MATMUL_SAVED = ("attention_q", "attention_k", "attention_v", "residual_mid", "mlp_gate", "mlp_up")
REMAT_POLICIES = {
    "attention": "the attention output and log-sum-exp; the backward runs the layer's "
    "projections again (least memory)",
    "matmuls": "also q, k, v, the residual after attention and the MLP's gate and up outputs; "
    "the backward runs no matmul again (H D + 2 K D + E + 2 F more values a token a layer)",
}


def saved_names(policy: str) -> tuple[str, ...]:
    """The activation names a rematerialised layer keeps under `policy` (REMAT_POLICIES)."""
    return ATTENTION_SAVED + (MATMUL_SAVED if policy == "matmuls" else ())


def keep(x: jax.Array, name: str, *, in_vjp_rule: bool = False) -> jax.Array:
    """x, named for a policy to save; outside a checkpointed function this is the identity.
    16-bit floats are named as their bit patterns on CPU (module docstring).

    in_vjp_rule: x is computed inside a custom VJP's forward rule (the blocked attention's
    output), where the rule's own backward defines the gradients; a nested custom VJP there
    would hide the name from the policy."""
    if jnp.dtype(x.dtype).itemsize != 2 or target.platform() != "cpu":
        return checkpoint_name(x, name)
    return _round_trip(x, name) if in_vjp_rule else _kept_as_bits(x, name)


def _round_trip(x, name):
    bits = checkpoint_name(jax.lax.bitcast_convert_type(x, jnp.uint16), name)
    return jax.lax.bitcast_convert_type(bits, x.dtype)


# The round trip through an integer type is the identity, but autodiff sees an integer and
# would stop the gradient there; a custom VJP passes the cotangent through unchanged. (A
# custom JVP hides the name from the checkpoint policy; a custom VJP's forward rule does not.)
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _kept_as_bits(x, name):
    return _round_trip(x, name)


def _kept_as_bits_fwd(x, name):
    return _round_trip(x, name), None


def _kept_as_bits_bwd(name, _, g):
    return (g,)


_kept_as_bits.defvjp(_kept_as_bits_fwd, _kept_as_bits_bwd)
