"""The custom-VJP head paths compose with JAX transformations (rl/logprobs.py, rl/losses.py).

chunked_logprobs, fused_token_loss and loss_from_hidden against plain autodiff of a pure-jnp
log_softmax reference, under grad, grad(jit), jit(grad), vmap(grad), gradient accumulation
with lax.scan (grad outside the scan and inside it) and jax.checkpoint. Every array (targets,
weights, advantages, behaviour/reference logprobs, loss coefficients) is an argument of the
function being transformed, so that under jit / scan / checkpoint they are tracers: a custom
VJP that closes over one of them leaks it.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.rl import losses
from pipelinerl_jax.rl.config import LossConfig
from pipelinerl_jax.rl.logprobs import chunked_logprobs, fused_token_loss

M, B, T, E, V = 3, 2, 5, 8, 13  # micro-batches of [B, T] tokens; V not a multiple of chunks
S = 3  # sequences per micro-batch (gspo)
_HI = jax.lax.Precision.HIGHEST


class Tok(NamedTuple):
    """The token fields loss_from_hidden reads (a pytree, so it can be scanned and vmapped)."""

    targets: jax.Array
    behaviour_logprobs: jax.Array
    advantages: jax.Array
    token_weights: jax.Array
    loss_mask: jax.Array
    sequence_index: jax.Array


def _data(seed=0):
    """hidden [M, B, T, E], W [E, V] and per-micro-batch data, all random (nothing zero)."""
    k = jax.random.split(jax.random.key(seed), 13)
    h = jax.random.normal(k[0], (M, B, T, E))
    w = 0.5 * jax.random.normal(k[1], (E, V))
    t = jax.random.randint(k[2], (M, B, T), 0, V)
    mask = (jax.random.uniform(k[3], (M, B, T)) < 0.8).astype(jnp.float32)
    batch = Tok(
        targets=t,
        behaviour_logprobs=mask * -jax.random.uniform(k[4], (M, B, T), minval=1.0, maxval=4.0),
        advantages=mask * jax.random.normal(k[5], (M, B, T)),
        token_weights=mask * jax.random.uniform(k[6], (M, B, T), minval=0.1, maxval=1.0),
        loss_mask=mask,
        sequence_index=jnp.where(mask > 0, jax.random.randint(k[7], (M, B, T), 0, S), S),
    )
    extra = dict(
        a=jax.random.normal(k[8], (M, B, T)),
        b=jax.random.normal(k[9], (M, B, T)),
        ref=-jax.random.uniform(k[10], (M, B, T), minval=1.0, maxval=4.0),
        coef=jax.random.uniform(k[11], (M, 2), minval=0.05, maxval=0.2),
        scale=jax.random.randint(k[12], (M,), 1, 4),
    )
    return h, w, batch, extra


def _reference_logprobs(h, w, t, temperature):
    """Pure jnp: whole f32 logits, log_softmax, take_along_axis."""
    z = jnp.dot(h, w, precision=_HI) / temperature
    logp = jax.nn.log_softmax(z, axis=-1)
    lp = jnp.take_along_axis(logp, t[..., None], axis=-1)[..., 0]
    return lp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


# Each case: (ours, reference), both f(h, w, batch, extra) -> scalar loss of one micro-batch.


def _chunked_case():
    def run(lp_fn):
        def f(h, w, batch, extra):
            lp, ent = lp_fn(h, w, batch.targets)
            return jnp.sum(extra["a"] * lp + extra["b"] * ent)

        return f

    return (
        run(lambda h, w, t: chunked_logprobs(h, w, t, temperature=0.7, vocab_chunk=4)),
        run(lambda h, w, t: _reference_logprobs(h, w, t, 0.7)),
    )


def _fused_case():
    def token_loss(coef, scale):
        # Closes over a traced float, as the trainer's loss does (scheduled coefficients), and
        # a traced integer, which jax.closure_convert would leave in the closure.
        def fn(lp, ent, inp):
            return jnp.sum(
                inp["a"] * lp + coef * inp["b"] * ent * ent * scale + inp["a"] * inp["b"]
            )

        return fn

    def ours(h, w, batch, extra):
        inputs = {"a": extra["a"], "b": extra["b"]}
        loss_fn = token_loss(extra["coef"][0], extra["scale"])
        return fused_token_loss(
            h, w, batch.targets, inputs, loss_fn, temperature=0.8, token_chunk=4
        )[0]

    def ref(h, w, batch, extra):
        lp, ent = _reference_logprobs(h, w, batch.targets, 0.8)
        inputs = {"a": extra["a"], "b": extra["b"]}
        return token_loss(extra["coef"][0], extra["scale"])(lp, ent, inputs)

    return ours, ref


_CONFIGS = {
    "tis": LossConfig(token_chunk=4, entropy_coef=0.01),
    "ppo": LossConfig(
        objective="ppo", kl_coef=0.1, entropy_coef=0.01, token_chunk=4, temperature=0.7
    ),
    "gspo": LossConfig(
        objective="gspo",
        gspo_eps_low=0.2,
        gspo_eps_high=0.3,
        vocab_chunk=4,
        entropy_coef=0.02,
        kl_coef=0.05,
    ),
}


def _objective_case(name):
    cfg = _CONFIGS[name]
    use_ref = cfg.kl_coef > 0

    def ours(h, w, batch, extra):
        # Traced loss coefficients and reference logprobs, like the trainer's schedules.
        loss, _ = losses.loss_from_hidden(
            cfg,
            h,
            w,
            batch,
            kl_coef=extra["coef"][0],
            entropy_coef=extra["coef"][1],
            ref_logprobs=extra["ref"] if use_ref else None,
            num_sequences=S,
        )
        return loss

    def ref(h, w, batch, extra):
        lp, ent = _reference_logprobs(h, w, batch.targets, cfg.temperature)
        args = (
            lp,
            batch.behaviour_logprobs,
            batch.advantages,
            batch.token_weights,
            batch.loss_mask,
        )
        kw = dict(
            entropy=ent,
            ref_logprobs=extra["ref"] if use_ref else None,
            kl_coef=extra["coef"][0],
            entropy_coef=extra["coef"][1],
        )
        if cfg.objective == "gspo":
            return losses.gspo(
                *args,
                batch.sequence_index,
                S,
                eps_low=cfg.gspo_eps_low,
                eps_high=cfg.gspo_eps_high,
                **kw,
            )[0]
        if cfg.objective == "ppo":
            return losses.ppo(*args, eps_low=cfg.ppo_eps_low, eps_high=cfg.ppo_eps_high, **kw)[0]
        return losses.tis_reinforce(*args, clip=cfg.tis_clip, **kw)[0]

    return ours, ref


CASES = {
    "chunked_logprobs": _chunked_case,
    "fused_token_loss": _fused_case,
    "loss_tis": lambda: _objective_case("tis"),
    "loss_ppo": lambda: _objective_case("ppo"),
    "loss_gspo": lambda: _objective_case("gspo"),
}


# Each transform: f -> runner(h_M, w, batch_M, extra_M) -> (values [M], dh [M, ...], dw summed
# over micro-batches), i.e. the gradient of the summed loss.


def _per_micro_batch(vg):
    def run(h, w, batch, extra):
        outs = [vg(h[m], w, *jax.tree.map(lambda x: x[m], (batch, extra))) for m in range(M)]
        values, dhs, dws = zip(*[(v, dh, dw) for v, (dh, dw) in outs])
        return jnp.stack(values), jnp.stack(dhs), sum(dws)

    return run


def _vmap_grad(f):
    def run(h, w, batch, extra):
        values, (dh, dw) = jax.vmap(jax.value_and_grad(f, (0, 1)), in_axes=(0, None, 0, 0))(
            h, w, batch, extra
        )
        return values, dh, dw.sum(0)

    return run


def _scan_grad_outside(f):
    """grad of a lax.scan that sums the micro-batch losses (accumulation inside the graph)."""

    def total(h, w, batch, extra):
        def body(acc, xs):
            h_m, batch_m, extra_m = xs
            v = f(h_m, w, batch_m, extra_m)
            return acc + v, v

        acc, values = jax.lax.scan(body, jnp.zeros(()), (h, batch, extra))
        return acc, values

    def run(h, w, batch, extra):
        (_, values), (dh, dw) = jax.value_and_grad(total, (0, 1), has_aux=True)(h, w, batch, extra)
        return values, dh, dw

    return run


def _scan_grad_inside(f):
    """Gradient accumulation as the trainer does it: grad per micro-batch in a scan body."""
    vg = jax.value_and_grad(f, (0, 1))

    def run(h, w, batch, extra):
        def body(dw_acc, xs):
            h_m, batch_m, extra_m = xs
            v, (dh, dw) = vg(h_m, w, batch_m, extra_m)
            return dw_acc + dw, (v, dh)

        dw, (values, dh) = jax.lax.scan(body, jnp.zeros_like(w), (h, batch, extra))
        return values, dh, dw

    return run


TRANSFORMS = {
    "grad": lambda f: _per_micro_batch(jax.value_and_grad(f, (0, 1))),
    "grad_of_jit": lambda f: _per_micro_batch(jax.value_and_grad(jax.jit(f), (0, 1))),
    "jit_of_grad": lambda f: _per_micro_batch(jax.jit(jax.value_and_grad(f, (0, 1)))),
    "vmap_of_grad": _vmap_grad,
    "scan_grad_outside": _scan_grad_outside,
    "scan_grad_inside": lambda f: jax.jit(_scan_grad_inside(f)),
    "remat": lambda f: _per_micro_batch(jax.value_and_grad(jax.checkpoint(f), (0, 1))),
    "remat_in_scan_of_jit": lambda f: jax.jit(_scan_grad_outside(jax.checkpoint(jax.jit(f)))),
}


def _close(got, want, rtol=1e-5):
    """f32 agreement relative to the magnitude of the whole array (sums cancel per element)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.max(np.abs(want)))


@pytest.fixture(scope="module")
def data():
    return _data()


@pytest.fixture(scope="module")
def references(data):
    """Per case: (values [M], dh, dw) of the reference, plain autodiff of the summed loss."""
    cache = {}

    def get(name):
        if name not in cache:
            _, ref = CASES[name]()
            cache[name] = jax.jit(_per_micro_batch(jax.value_and_grad(ref, (0, 1))))(*data)
        return cache[name]

    return get


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("case", list(CASES))
def test_values_and_grads_under_transform(case, transform, data, references):
    ours, _ = CASES[case]()
    values, dh, dw = TRANSFORMS[transform](ours)(*data)
    want_values, want_dh, want_dw = references(case)
    _close(values, want_values)
    _close(dh, want_dh)
    _close(dw, want_dw)


def test_reference_gradients_are_not_trivial(data, references):
    """Guards the comparison above: the gradients are dense, O(1) and differ across batches."""
    for case in CASES:
        _, dh, dw = references(case)
        assert np.all(np.isfinite(dh)) and np.all(np.isfinite(dw))
        assert np.mean(np.abs(np.asarray(dw)) > 1e-6) > 0.9, case
        assert not np.allclose(dh[0], dh[1]), case
