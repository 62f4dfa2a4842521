"""A layer scan whose backward adds each layer's parameter gradient into an accumulator in place.

Gradient accumulation over micro-batches holds two full-model gradients at once: the
accumulator, and the micro-batch's gradient that JAX's transpose of the layer scan writes into
a fresh stacked [L, ...] buffer before it is added. `scan_layers(..., grads_into=acc_L)`
computes the same values, but its backward is a reverse scan that carries the accumulator and
adds layer l's gradient into slice l (a dynamic-update-slice of a loop-carried buffer, which
XLA does in place), so the second copy never exists.

Where the sum comes out: as the cotangent of `grads_into` itself. Differentiating w.r.t.
`grads_into` returns `acc_L + (the gradient w.r.t. params_L)`, cast to the accumulator's
dtype, and `params_L` gets no cotangent from this scan. So an f32 accumulator serves bf16
params too (a cotangent must have its primal's dtype, and the accumulator is the primal here).

The forward keeps exactly what the plain scan keeps: each layer runs under `jax.vjp`, and the
residuals of its VJP (the layer input and whatever the layer's `jax.checkpoint` policy saves)
are stacked along L. Residuals that are the layer's own parameters are not stacked (the
backward reads them from `params_L`, as JAX's scan forwards them).

Letters (pipelinerl_jax/__init__.py): L layers.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def scan_layers(body: Callable, x, params_L, *, grads_into=None):
    """`lax.scan(lambda x, lp: (body(x, lp), None), x, params_L)[0]`.

    grads_into: None, or a pytree like params_L (same shapes; floating dtypes, which may be
    wider than the params'): then the cotangent this function returns for grads_into is
    grads_into plus the gradient w.r.t. params_L, built in place, and params_L gets none."""
    if grads_into is None:
        return jax.lax.scan(lambda h, lp: (body(h, lp), None), x, params_L)[0]
    for p, a in zip(jax.tree.leaves(params_L), jax.tree.leaves(grads_into), strict=True):
        if p.shape != a.shape or not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(
                f"scan_layers: grads_into leaf {a.dtype}{list(a.shape)} does not match its "
                f"parameter {p.dtype}{list(p.shape)}: give a float array of the same shape"
            )
    return _accumulating(body)(x, params_L, grads_into)


def _accumulating(body: Callable):
    # How a layer's VJP residuals map to stacked arrays: set while the forward traces, read by
    # the backward (both trace once per call of scan_layers).
    layout = {}

    @jax.custom_vjp
    def run(x, params_L, grads_into):
        del grads_into
        return jax.lax.scan(lambda h, lp: (body(h, lp), None), x, params_L)[0]

    def fwd(x, params_L, grads_into):
        def layer(h, lp):
            out, vjp_fn = jax.vjp(body, h, lp)
            leaves, layout["treedef"] = jax.tree.flatten(vjp_fn)
            lp_leaves = jax.tree.leaves(lp)
            sources, stacked = [], []
            for leaf in leaves:
                own = next((i for i, w in enumerate(lp_leaves) if leaf is w), None)
                if own is None:
                    sources.append((False, len(stacked)))
                    stacked.append(leaf)
                else:
                    sources.append((True, own))
            layout["sources"] = tuple(sources)
            return out, stacked

        out, residuals_L = jax.lax.scan(layer, x, params_L)
        return out, (residuals_L, params_L, grads_into)

    def bwd(res, d_out):
        residuals_L, params_L, grads_into = res
        num_layers = jax.tree.leaves(params_L)[0].shape[0]

        def layer(carry, xs):
            d_h, acc = carry
            index, stacked, lp = xs
            lp_leaves = jax.tree.leaves(lp)
            leaves = [lp_leaves[i] if own else stacked[i] for own, i in layout["sources"]]
            d_h, d_lp = jax.tree.unflatten(layout["treedef"], leaves)(d_h)
            acc = jax.tree.map(
                lambda a, g: jax.lax.dynamic_update_index_in_dim(
                    a, a[index] + g.astype(a.dtype), index, 0
                ),
                acc,
                d_lp,
            )
            return (d_h, acc), None

        xs = (jnp.arange(num_layers), residuals_L, params_L)
        (d_x, acc), _ = jax.lax.scan(layer, (d_out, grads_into), xs, reverse=True)
        return d_x, None, acc

    run.defvjp(fwd, bwd)
    return run
