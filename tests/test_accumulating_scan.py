"""Gradients added into the accumulator in place: same values as accumulator + gradient, less held."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from pipelinerl_jax.models import accumulating_scan, attention, decoder
from pipelinerl_jax.rl.batch import build_batch
from pipelinerl_jax.rl.config import BatchConfig, LossConfig
from pipelinerl_jax.train import trainer as tr
from tests.test_trainer import samples, tiny_model

L, N, E, F = 5, 24, 8, 12


def _layer(h_NxE, lp):
    u_NxF = checkpoint_name(h_NxE @ lp["w_in"], "saved")
    return h_NxE + jnp.tanh(u_NxF) @ lp["w_out"] * lp["scale"]


def _inputs(seed):
    k = jax.random.split(jax.random.key(seed), 7)
    params_L = {
        "w_in": jax.random.normal(k[0], (L, E, F)) / 3,
        "w_out": jax.random.normal(k[1], (L, F, E)) / 3,
        "scale": jax.random.normal(k[2], (L, E)),
    }
    acc_L = {
        "w_in": jax.random.normal(k[3], (L, E, F)),
        "w_out": jax.random.normal(k[4], (L, F, E)),
        "scale": jax.random.normal(k[5], (L, E)),
    }
    return params_L, acc_L, jax.random.normal(k[6], (N, E))


@pytest.mark.parametrize("remat", [None, "saved", "nothing"])
def test_grad_is_accumulator_plus_gradient(remat):
    body = _layer
    if remat == "saved":
        policy = jax.checkpoint_policies.save_only_these_names("saved")
        body = jax.checkpoint(_layer, prevent_cse=False, policy=policy)
    elif remat == "nothing":
        body = jax.checkpoint(_layer, prevent_cse=False)
    params_L, acc_L, x_NxE = _inputs(0)

    def loss(p, acc, x):
        out = accumulating_scan.scan_layers(body, x, p, grads_into=acc)
        return jnp.sum(jnp.sin(out))

    plain = jax.grad(lambda p, x: loss(p, None, x), argnums=(0, 1))(params_L, x_NxE)
    # jit(grad(...)), as the trainer runs it, and grad(jit(...)): the sum comes back as the
    # accumulator's cotangent, the params get none from the scan, the input's is unchanged.
    for got in (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params_L, acc_L, x_NxE),
        jax.grad(jax.jit(loss), argnums=(0, 1, 2))(params_L, acc_L, x_NxE),
    ):
        for key in params_L:
            np.testing.assert_allclose(
                got[1][key], acc_L[key] + plain[0][key], rtol=1e-6, atol=1e-6
            )
            assert not np.any(got[0][key])
        np.testing.assert_allclose(got[2], plain[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(loss(params_L, acc_L, x_NxE), loss(params_L, None, x_NxE), rtol=1e-7)


def test_accumulates_over_a_scan_of_micro_batches():
    """lax.scan accumulation, as the trainer's micro-batches: the carry is the gradient sum."""
    params_L, _, _ = _inputs(1)
    xs_MxNxE = jax.random.normal(jax.random.key(9), (3, N, E))

    def loss(p, acc, x):
        return jnp.sum(accumulating_scan.scan_layers(_layer, x, p, grads_into=acc) ** 2)

    def summed(p):
        step = lambda acc, x: (jax.grad(loss, argnums=1)(p, acc, x), None)  # noqa: E731
        return jax.lax.scan(step, jax.tree.map(jnp.zeros_like, p), xs_MxNxE)[0]

    want = jax.grad(lambda p: sum(loss(p, None, x) for x in xs_MxNxE))(params_L)
    got = jax.jit(summed)(params_L)
    for key in params_L:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5)


def test_a_misshapen_or_integer_accumulator_is_refused():
    params_L, acc_L, x_NxE = _inputs(2)
    for bad in (acc_L["w_in"][:, :4], acc_L["w_in"].astype(jnp.int32)):
        with pytest.raises(ValueError, match=r"grads_into leaf \w+\[5, \d+, 12\] does not match"):
            accumulating_scan.scan_layers(
                _layer, x_NxE, params_L, grads_into={**acc_L, "w_in": bad}
            )


def test_an_f32_accumulator_takes_bf16_parameters_gradients():
    """The sum is the accumulator's cotangent, in its dtype: bf16 params, f32 sums."""
    params_L, acc_L, x_NxE = _inputs(3)
    params_L = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params_L)

    def loss(p, acc, x):
        out = accumulating_scan.scan_layers(_layer, x.astype(jnp.bfloat16), p, grads_into=acc)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    plain = jax.grad(lambda p: loss(p, None, x_NxE))(params_L)
    got = jax.jit(jax.grad(loss, argnums=1))(params_L, acc_L, x_NxE)
    for key in params_L:
        assert got[key].dtype == jnp.float32
        np.testing.assert_allclose(got[key], acc_L[key] + plain[key].astype(jnp.float32))


@pytest.mark.parametrize("remat_policy", [None, "matmuls"])
def test_decoder_layer_gradients_land_in_the_accumulator(remat_policy):
    cfg = tiny_model(num_layers=3, tie_word_embeddings=True)
    if remat_policy:
        cfg = dataclasses.replace(cfg, remat=True, remat_policy=remat_policy)
    graphdef, params = decoder.init(cfg, jax.random.key(5))
    p = decoder.arrays(params)
    acc_layers = jax.tree.map(
        lambda w: jax.random.normal(jax.random.key(w.size), w.shape), p["layers"]
    )
    tokens = jax.random.randint(jax.random.key(6), (2, 11), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
    attend = attention.segment_causal_attention(jnp.zeros((2, 11), jnp.int32))

    def loss(params, acc):
        hidden, _ = decoder.forward_hidden(
            graphdef, params, tokens, positions, attend=attend, layer_grads_into=acc
        )
        return jnp.sum(hidden * jnp.cos(hidden))

    plain = jax.grad(loss)(p, None)
    got, sums = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, acc_layers)
    for key in p["layers"]:
        np.testing.assert_allclose(
            sums[key], acc_layers[key] + plain["layers"][key], rtol=2e-5, atol=2e-6
        )
    np.testing.assert_allclose(got["embed"], plain["embed"], rtol=2e-5, atol=2e-6)


def _micro_trainer(in_place: bool, **sizes):
    cfg = tiny_model(num_layers=3, remat=True, remat_policy="matmuls", **sizes)
    graphdef, params = decoder.init(cfg, jax.random.key(7))
    tcfg = tr.TrainerConfig(
        learning_rate=1e-2,
        warmup_steps=0,
        lr_schedule="constant",
        micro_batches=3,
        accumulate_in_place=in_place,
        loss=LossConfig(objective="ppo", entropy_coef=0.01),
    )
    trainer = tr.Trainer(tcfg, graphdef, decoder.abstract_init(cfg)[1], tr.trainer_mesh())
    batch, _ = build_batch(
        samples([(3, 6), (4, 5), (2, 7), (3, 4), (5, 3), (2, 2)], seed=11),
        BatchConfig(seq_len=16, num_rows=6, max_sequences=6, max_sequence_len=12),
    )
    return trainer, params, batch


@pytest.mark.parametrize(
    "param_dtype,compute_dtype",
    [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16")],
)
def test_trainer_in_place_accumulation_takes_the_same_steps(param_dtype, compute_dtype):
    """f32 params in f32 or bf16 compute (the layer casts them inside the scanned body), and
    bf16 params, whose gradients the f32 accumulator sums."""
    tol = 1e-5 if compute_dtype == "float32" else 2e-3
    runs = {}
    for in_place in (True, False):
        trainer, params, batch = _micro_trainer(
            in_place, param_dtype=param_dtype, compute_dtype=compute_dtype
        )
        state = trainer.init_state(params)
        history = []
        for _ in range(3):
            state, metrics = trainer.train_step(state, batch)
            history.append(jax.device_get(metrics))
        runs[in_place] = (jax.device_get(state.params), history)
    for a, b in zip(jax.tree.leaves(runs[True][0]), jax.tree.leaves(runs[False][0])):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol / 10)
    for ma, mb in zip(runs[True][1], runs[False][1]):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(ma[key], mb[key], rtol=tol)


def _step_temp_bytes(trainer, params, batch) -> int:
    state = trainer.init_state(params)
    lowered = trainer.lower(state, batch)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_in_place_accumulation_holds_one_gradient_fewer():
    """XLA's buffer assignment of the step: the micro-batch's stacked layer gradient is gone
    (on the real config, 1.44 -> 1.04 GiB of temporaries)."""
    # Layers large beside the tiny batch's activations, as in a real model's step.
    sizes = dict(hidden_size=64, intermediate_size=192, head_dim=16)
    in_place, params, batch = _micro_trainer(True, **sizes)
    summed, _, _ = _micro_trainer(False, **sizes)
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(decoder.arrays(params)["layers"]))
    saved = _step_temp_bytes(summed, params, batch) - _step_temp_bytes(in_place, params, batch)
    # What remains is one layer's gradient at a time, before it is added into its slice.
    assert saved >= 0.95 * layer_bytes * (3 - 1) / 3, (saved, layer_bytes)
