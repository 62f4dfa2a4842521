"""The decoder block in both layouts: the sampler's unrolled forward against the model's own.

The sampler runs the model's block (models/block.py) unrolled over per-layer params, in the
feature-major layout on CPU (output-major weights, [E, N] activations) or token-major (plain
JAX, the GPU path); transformers parity is checked end to end in test_sampler_engine.py on a
plain Llama and in test_model_gemma.py. Here the options that test does not reach (q/k/v bias,
qk-norm, llama3 RoPE, tied and untied heads, bf16 compute, Gemma's norm, activation and
embedding scale) are checked against `decoder.forward` with the same causal attention, and the
converted weights are checked against the model's by hand.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax.models import attention, block, decoder
from pipelinerl_jax.sampler import forward as fwd
from tests.tiny_models import every_option

CFG = every_option(vocab_size=80, intermediate_size=48)


def _model(cfg, seed):
    graphdef, params = decoder.init(cfg, jax.random.key(seed))
    pure = nnx.to_pure_dict(params)
    rng = np.random.default_rng(seed)
    # Random norms and biases, so a misplaced norm weight or bias shows.
    for key in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "q_bias", "k_bias", "v_bias"):
        if key in pure["layers"]:
            w = pure["layers"][key]
            pure["layers"][key] = w + 0.3 * jnp.asarray(rng.standard_normal(w.shape), w.dtype)
    nnx.replace_by_pure_dict(params, pure)
    return graphdef, params


def _sampler_logits(cfg, layout, params, tokens_BxT, positions_BxT):
    causal = attention.segment_causal_attention(jnp.zeros(tokens_BxT.shape, jnp.int32))

    def attend(q, k, v, layer_and_carry):
        out, _ = causal(q, k, v, None)
        return out, layer_and_carry

    dparams = fwd.decode_params(cfg, params, layout)
    hidden, carry = fwd.forward_hidden(
        cfg, dparams, tokens_BxT, positions_BxT, attend, "c", layout=layout
    )
    assert carry == "c"
    logits_VxN = fwd.logits_vocab_major(dparams, hidden.reshape(-1, hidden.shape[-1]).T)
    return logits_VxN.T.reshape(*tokens_BxT.shape, -1)


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # every option on
        dict(
            tie_word_embeddings=True,
            attention_bias=False,
            qk_norm=False,
            rope_scaling=None,
            model_type="llama",
        ),
        dict(compute_dtype="bfloat16"),
        dict(model_type="gemma", attention_bias=False, qk_norm=False, tie_word_embeddings=True),
    ],
)
@pytest.mark.parametrize("layout", fwd.LAYOUTS)
def test_sampler_forward_equals_model_forward(options, layout):
    cfg = dataclasses.replace(CFG, **options)
    graphdef, params = _model(cfg, seed=len(options))
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 7)), jnp.int32)
    positions = jnp.asarray(rng.integers(0, 40, (3, 1)) + np.arange(7), jnp.int32)
    want = jax.jit(decoder.forward, static_argnums=0)(graphdef, params, tokens, positions)
    got = jax.jit(_sampler_logits, static_argnums=(0, 1))(cfg, layout, params, tokens, positions)
    assert got.shape == want.shape == (3, 7, cfg.vocab_size) and got.dtype == jnp.float32
    got, want = np.asarray(got), np.asarray(want)
    if cfg.compute_dtype == "bfloat16":
        # The two forwards round activations to bf16 (8 mantissa bits, 2^-8 relative) at
        # different points through 2 layers, so they differ by a few roundings of the logits'
        # scale: measured 0.8% of max|logit| (2.5e-3 on logits up to 0.31; the bf16 model itself
        # differs from f32 by 0.6%). Four roundings of the largest logit: ~2x the measured gap.
        tol = 4 * 2.0**-8 * np.abs(want).max()
        np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    else:
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_prepare_layer_is_output_major():
    graphdef, params = _model(CFG, seed=0)
    p = decoder.arrays(params)
    lp = {name: w[1] for name, w in p["layers"].items()}
    n_in = block.matmul_inputs(decoder.param_specs(CFG))
    out = block.FeatureMajor().prepare(lp, n_in, jnp.float32)
    e, h, k, d, f = 32, 4, 2, 8, 48
    shapes = {
        "q_proj": (h * d, e),
        "k_proj": (k * d, e),
        "v_proj": (k * d, e),
        "o_proj": (e, h * d),
        "gate_proj": (f, e),
        "up_proj": (f, e),
        "down_proj": (e, f),
    }
    for name, shape in shapes.items():
        assert out[name].shape == shape, name
    # Row 2 * d + 3 of q is head 2, dim 3; column 1 * d + 5 of o_proj is head 1, dim 5.
    np.testing.assert_array_equal(out["q_proj"][2 * d + 3], lp["q_proj"][:, 2, 3])
    np.testing.assert_array_equal(out["o_proj"][:, 1 * d + 5], lp["o_proj"][1, 5, :])
    np.testing.assert_array_equal(out["down_proj"], lp["down_proj"].T)
    np.testing.assert_array_equal(out["q_bias"], lp["q_bias"])  # non-projections as is


@pytest.mark.parametrize("norm", [block.rms_norm, block.rms_norm_plus_one])
def test_rms_norm_over_the_feature_axis_equals_token_major(norm):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(16), jnp.float32)
    np.testing.assert_array_equal(norm(x.T, w, 1e-6, axis=0).T, norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_project_accumulates_in_f32_in_both_forms(dtype, tokens):
    """FeatureMajor.project (`one_16bit_token` for one 16-bit token, the plain product otherwise) equals
    the f32 product of the same values, rounded once to the input dtype."""
    rng = np.random.default_rng(tokens)
    w = jnp.asarray(rng.standard_normal((24, 40)), dtype)
    x = jnp.asarray(rng.standard_normal((40, tokens)), dtype)
    got = jax.jit(lambda w, x: block.FeatureMajor().project(x, w, 1))(w, x)
    assert got.shape == (24, tokens) and got.dtype == jnp.dtype(dtype)
    want = np.asarray(w, np.float64) @ np.asarray(x, np.float64)
    tol = 1e-2 if dtype == "bfloat16" else 1e-5  # one bf16 rounding of the output
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


@pytest.fixture(params=[True, False], ids=["amx", "no_amx"])
def amx(request, monkeypatch):
    """Both forms of `one_16bit_token`, whatever CPU runs the test."""
    monkeypatch.setattr(block.cpu_matrix_units, "has_amx", lambda: request.param)
    return request.param


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_16bit_token_is_the_f32_product_of_its_values_in_both_forms(amx, dtype):
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((96, 160)), dtype)
    x = jnp.asarray(rng.standard_normal((160, 1)), dtype)
    got = jax.jit(block.output_major_matmul)(w, x)
    assert got.shape == (96, 1) and got.dtype == jnp.float32
    want = np.asarray(w, np.float64) @ np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)


def test_one_16bit_token_in_a_loop_reads_its_weights_as_16_bits(amx):
    """Inside a decode-like loop the weights are loop-invariant: XLA must not hoist their
    conversion out of the loop (an f32 copy of every weight each call, twice the bytes read
    each step): the compiled program's scratch memory has no room for an f32 copy of them."""
    rng = np.random.default_rng(8)
    w = jnp.asarray(rng.standard_normal((96, 96)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((96, 1)), jnp.float32)

    def steps(w, x):
        def body(_, x):
            y = block.output_major_matmul(w, x.astype(w.dtype))
            return y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)

        return jax.lax.fori_loop(0, 4, body, x)

    scratch = jax.jit(steps).lower(w, x).compile().memory_analysis().temp_size_in_bytes
    assert scratch < 96 * 96 * 4
    want = np.asarray(x, np.float64)
    w64 = np.asarray(w, np.float64)
    for _ in range(4):
        y = w64 @ np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64)
        want = y / np.sqrt(np.mean(y * y) + 1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(steps)(w, x)), want, rtol=2e-2, atol=2e-2)


def test_has_amx_reads_the_cpu_flags(tmp_path):
    from pipelinerl_jax.models import cpu_matrix_units

    with_amx, without = tmp_path / "a", tmp_path / "b"
    with_amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert cpu_matrix_units.has_amx(str(with_amx)) is True
    assert cpu_matrix_units.has_amx(str(without)) is False
    assert cpu_matrix_units.has_amx(str(tmp_path / "missing")) is False


@pytest.mark.parametrize("head_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_sampler_head_runs_in_its_dtype_with_f32_accumulation(head_dtype, tokens):
    """decode_params' head_dtype: the head and the hidden state rounded to it, the product
    accumulated in f32 (what rl/logprobs computes with the same loss.head_dtype), at one token
    (`one_16bit_token`) and several."""
    cfg = dataclasses.replace(CFG, tie_word_embeddings=True, compute_dtype="bfloat16")
    _, params = _model(cfg, seed=5)
    dparams = fwd.decode_params(cfg, params, head_dtype=head_dtype)
    assert dparams["head_VxE"].dtype == jnp.dtype(head_dtype)
    rng = np.random.default_rng(tokens)
    hidden_ExN = jnp.asarray(rng.standard_normal((cfg.hidden_size, tokens)), jnp.bfloat16)
    got = jax.jit(fwd.logits_vocab_major)(dparams, hidden_ExN)
    assert got.shape == (cfg.vocab_size, tokens) and got.dtype == jnp.float32
    w_VxE = np.asarray(
        decoder.lm_head_weight(params).astype(head_dtype).T.astype(jnp.float32), np.float64
    )
    want = w_VxE @ np.asarray(hidden_ExN.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)
    f32_head = fwd.logits_vocab_major(fwd.decode_params(cfg, params), hidden_ExN)
    if head_dtype == "bfloat16":  # the rounded head is a different head
        assert not np.allclose(np.asarray(f32_head), np.asarray(got), rtol=0, atol=1e-6)


def test_decode_params_hold_a_16_bit_embedding_as_bits():
    """A bf16 table is stored as its uint16 patterns (an integer gather on CPU); the rows
    block.embed returns from it are the float table's rows exactly, Gemma's scale included."""
    for model_type in ("llama", "gemma"):
        cfg = dataclasses.replace(
            CFG, compute_dtype="bfloat16", model_type=model_type, tie_word_embeddings=True
        )
        _, params = _model(cfg, seed=1)
        dparams = fwd.decode_params(cfg, params)
        assert dparams["embed"].dtype == jnp.uint16
        table = decoder.arrays(params)["embed"].astype(jnp.bfloat16)
        family = decoder.family_of(cfg)
        tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 5)))
        got = block.embed(cfg, family, dparams["embed"], tokens, jnp.bfloat16)
        want = block.embed(cfg, family, table, tokens, jnp.bfloat16)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    f32 = fwd.decode_params(CFG, _model(CFG, seed=1)[1])
    assert f32["embed"].dtype == jnp.float32  # f32 tables stay floats


def test_bad_head_dtype_is_named():
    with pytest.raises(Exception, match="head_dtype='int8'"):
        fwd.decode_params(CFG, _model(CFG, seed=0)[1], head_dtype="int8")
