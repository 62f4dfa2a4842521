"""The decoder's own contracts: packed rows, the cache hook, remat, dtypes, param metadata.

Parity with transformers lives in test_hf_io.py; here the model is checked against itself
(packed vs one by one, cached decoding vs full forward) so each property is isolated. Most
checks share one [2, 8] input shape so that one compile serves them.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax.models import attention, block, config_json, decoder, param_counts
from tests.tiny_models import every_option

# Every optional piece on at once (q/k/v bias, qk-norm, llama3 rope, untied head).
CFG = every_option(vocab_size=96, max_position_embeddings=128)


@pytest.fixture(scope="module")
def model():
    graphdef, params = decoder.init(CFG, jax.random.key(1))
    # Random norms so that norm weights matter in the checks below.
    pure = nnx.to_pure_dict(params)
    rng = np.random.default_rng(0)
    for key in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
        w = pure["layers"][key]
        pure["layers"][key] = w + 0.2 * jnp.asarray(rng.standard_normal(w.shape), w.dtype)
    nnx.replace_by_pure_dict(params, pure)
    return graphdef, params


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def forward_2x8(graphdef, params, tokens, positions=None, segments=None):
    """jit_forward at the one [2, 8] shape most tests use (one compile per graphdef)."""
    assert tokens.shape == (2, 8)
    if positions is None:
        positions = np.broadcast_to(np.arange(8), (2, 8))
    if segments is None:
        segments = np.zeros((2, 8), int)
    return decoder.jit_forward(
        graphdef,
        params,
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(segments, jnp.int32),
    )


def test_params_stacked_named_and_counted(model):
    graphdef, params = model
    assert decoder.config_of(graphdef) == CFG
    assert sum(x.size for x in jax.tree.leaves(params)) == param_counts.num_params(CFG)
    for path, var in nnx.to_flat_state(params):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == var.get_value().ndim, path
        if path[0] == "layers":
            assert names[0] == "layers" and var.get_value().shape[0] == CFG.num_layers
    assert decoder.lm_head_weight(params).shape == (CFG.hidden_size, CFG.vocab_size)


def test_packed_rows_equal_sequences_one_by_one(model):
    """Row 0 packs sequences of 3 and 5 tokens, row 1 one of 6 plus 2 padding tokens; each
    sequence alone (right-padded to the same width, so one compile serves all) must agree."""
    graphdef, params = model
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, CFG.vocab_size, n) for n in (3, 5, 6)]
    tokens = np.stack([np.concatenate(seqs[:2]), np.concatenate([seqs[2], [0, 0]])])
    positions = np.stack([np.r_[0:3, 0:5], np.r_[0:6, 0:2]])
    segments = np.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 0, 0]])
    packed = np.asarray(forward_2x8(graphdef, params, tokens, positions, segments))
    assert packed.dtype == np.float32 and packed.shape == (2, 8, CFG.vocab_size)
    assert np.isfinite(packed).all()  # the padding segment too
    alone_tokens = np.zeros((2, 8), int)
    alone_tokens[0, :3], alone_tokens[1, :5] = seqs[0], seqs[1]
    alone = np.asarray(forward_2x8(graphdef, params, alone_tokens))
    alone2 = np.asarray(forward_2x8(graphdef, params, tokens[1:].repeat(2, 0)))
    # Same math on the same values; only reduction order over masked keys may differ.
    assert rel_err(packed[0, :3], alone[0, :3]) < 1e-5
    assert rel_err(packed[0, 3:], alone[1, :5]) < 1e-5
    assert rel_err(packed[1, :6], alone2[0, :6]) < 1e-5
    # Packing is not a no-op: without segments the second sequence would see the first.
    unsegmented = np.asarray(forward_2x8(graphdef, params, tokens, positions))
    assert rel_err(unsegmented[0, 3:], alone[1, :5]) > 1e-3


def test_eager_forward_agrees_with_jit(model):
    graphdef, params = model
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 8))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    eager = decoder.forward(graphdef, params, jnp.asarray(tokens), positions)
    assert rel_err(forward_2x8(graphdef, params, tokens), eager) < 1e-5


def dense_cache_attend(positions_BxT):
    """A minimal KV cache through the `cache` hook: layer_cache = (k_BxSxKxD, v_BxSxKxD)."""

    def attend(q, k, v, layer_cache):
        k_cache, v_cache = layer_cache
        start = positions_BxT[0, 0]
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k, start, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v, start, axis=1)
        S = k_cache.shape[1]
        mask_BxTxS = jnp.arange(S)[None, None, :] <= positions_BxT[:, :, None]
        return attention.masked_attention(q, k_cache, v_cache, mask_BxTxS), (k_cache, v_cache)

    return attend


def test_cached_decoding_equals_full_forward(model):
    """Decode 8 tokens one at a time through `cache` (a dense KV cache scanned with the layers):
    the same logits as one full pass."""
    graphdef, params = model
    B, T, S = 2, 8, 12
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (B, T)))
    full = forward_2x8(graphdef, params, tokens)
    shape = (CFG.num_layers, B, S, CFG.num_kv_heads, CFG.head_dim)
    cache = (jnp.zeros(shape), jnp.zeros(shape))

    @jax.jit
    def step(params, cache, tokens_BxT, positions_BxT):
        hidden, cache = decoder.forward_hidden(
            graphdef,
            params,
            tokens_BxT,
            positions_BxT,
            attend=dense_cache_attend(positions_BxT),
            cache=cache,
        )
        return decoder.logits_from_hidden(params, hidden), cache

    outs = []
    for t in range(T):
        logits, cache = step(params, cache, tokens[:, t : t + 1], jnp.full((B, 1), t))
        outs.append(logits)
    assert cache[0].shape == shape and float(jnp.abs(cache[0][:, :, T:]).max()) == 0
    assert rel_err(jnp.concatenate(outs, axis=1), full) < 1e-5


def test_remat_same_values_and_grads(model):
    graphdef, params = model
    g_remat, _ = decoder.abstract_init(dataclasses.replace(CFG, remat=True))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 8)))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))

    def loss(params, graphdef):
        logits = decoder.forward(graphdef, params, tokens, positions)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (v1, g1), (v2, g2) = grad(params, graphdef), grad(params, g_remat)
    assert abs(float(v1) - float(v2)) < 1e-6
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # In numpy: jnp's abs and max were compiled once per leaf shape, a second here.
    assert all(np.abs(np.asarray(a)).max() > 0 for a in jax.tree.leaves(g1))


def _blocked_loss(seg, tokens, positions):
    def loss(params, graphdef):
        attend = attention.blocked_causal_attention(seg, 5)
        hidden, _ = decoder.forward_hidden(graphdef, params, tokens, positions, attend=attend)
        logits = decoder.logits_from_hidden(params, hidden)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    return loss


def _blocked_inputs(rng):
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 12)))
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    seg = jnp.asarray([[1] * 5 + [2] * 7, [1] * 12])
    return seg, tokens, positions


@pytest.fixture(scope="module")
def plain_grads(model):
    """plain_grads(seed, compute_dtype) -> (value, grads) of the blocked loss on
    _blocked_inputs(seed) without remat: the reference both remat policies of a test are
    compared with, compiled once for the two (a compile of seconds)."""
    graphdef, params = model
    done = {}

    def get(seed: int, compute_dtype: str):
        if (seed, compute_dtype) not in done:
            loss = _blocked_loss(*_blocked_inputs(np.random.default_rng(seed)))
            plain = graphdef
            if compute_dtype != CFG.compute_dtype:
                plain, _ = decoder.abstract_init(
                    dataclasses.replace(CFG, compute_dtype=compute_dtype)
                )
            done[seed, compute_dtype] = jax.jit(jax.value_and_grad(loss), static_argnums=1)(
                params, plain
            )
        return done[seed, compute_dtype]

    return get


@pytest.mark.parametrize("policy", ["attention", "matmuls"])
def test_remat_keeps_the_blocked_attention_and_its_gradients(model, plain_grads, policy, capsys):
    """The trainer's layer: blocked attention (hand-written VJP) under per-layer remat. Values
    and gradients equal the plain backward under either policy, and the policy saves what it
    names: the attention's output and log-sum-exp (remat.ATTENTION_SAVED) instead of running
    attention again, and with "matmuls" also q, k, v, the mid residual, gate and up."""
    graphdef, params = model
    cfg = dataclasses.replace(CFG, remat=True, remat_policy=policy)
    g_remat, _ = decoder.abstract_init(cfg)
    loss = _blocked_loss(*_blocked_inputs(np.random.default_rng(5)))
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (v1, g1), (v2, g2) = plain_grads(5, CFG.compute_dtype), grad(params, g_remat)
    assert abs(float(v1) - float(v2)) < 1e-6
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    jax.ad_checkpoint.print_saved_residuals(lambda p: loss(p, g_remat), params)
    printed = capsys.readouterr().out
    # Through the layer scan the names are gone; the stacked shapes say what was saved:
    # every layer's attention output [L, B, K, G, T, D] and log-sum-exp [L, B, K, G, T].
    L, K, H, D = CFG.num_layers, CFG.num_kv_heads, CFG.num_heads, CFG.head_dim
    G, F = H // K, CFG.intermediate_size
    attention_saves = [(L, 2, K, G, 12, D), (L, 2, K, G, 12)]
    # q [L, B, T, H, D], k and v [L, B, T, K, D], gate and up [L, B, T, F].
    matmul_saves = [(L, 2, 12, H, D), (L, 2, 12, K, D), (L, 2, 12, F)]
    for shape in attention_saves + (matmul_saves if policy == "matmuls" else []):
        assert f"f32[{','.join(map(str, shape))}] output of scan" in printed, printed
    if policy == "attention":
        for shape in matmul_saves:
            assert f"f32[{','.join(map(str, shape))}] output of scan" not in printed, printed


def _count_dots(jaxpr) -> int:
    """dot_general equations in a jaxpr and every jaxpr nested in its equations' params."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _count_dots(inner)
    return count


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmuls_policy_recomputes_no_matmul(model, dtype):
    """What "matmuls" buys: its backward runs as many matmuls as the plain (no remat) one,
    where "attention" runs the layer's projections again (q, k, v, o, gate, up: 6 more), in
    f32 and in bf16 (where the kept values are bit patterns on CPU)."""
    graphdef, params = model
    loss = _blocked_loss(*_blocked_inputs(np.random.default_rng(6)))

    def dots(**remat):
        cfg = dataclasses.replace(CFG, compute_dtype=dtype, **remat)
        g, _ = decoder.abstract_init(cfg)
        closed = jax.make_jaxpr(jax.grad(lambda p: loss(p, g)))(params)
        return _count_dots(closed.jaxpr)

    keeping = dots(remat=True, remat_policy="matmuls")
    assert keeping == dots()
    assert dots(remat=True, remat_policy="attention") == keeping + 6


@pytest.mark.parametrize("policy", ["attention", "matmuls"])
def test_bf16_remat_keeps_bit_patterns_and_the_same_gradients(model, plain_grads, policy, capsys):
    """bf16 compute under remat: what the policy keeps is stacked as uint16 bit patterns on
    CPU (XLA:CPU converted a bf16 [L, ...] buffer to f32 and back for every layer's
    dynamic-update-slice; models/remat.py), so the compiled step updates no bf16 stack, and
    values and gradients are those of the bf16 step without remat."""
    graphdef, params = model
    bf16 = dataclasses.replace(CFG, compute_dtype="bfloat16")
    g_remat, _ = decoder.abstract_init(dataclasses.replace(bf16, remat=True, remat_policy=policy))
    loss = _blocked_loss(*_blocked_inputs(np.random.default_rng(7)))
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (v1, g1), (v2, g2) = plain_grads(7, "bfloat16"), grad(params, g_remat)
    assert abs(float(v1) - float(v2)) < 1e-3 * abs(float(v1))
    # Every leaf, the embedding's included: a bit-pattern round trip that autodiff could see
    # would stop the gradient at the first kept value and zero everything before it. (In
    # numpy: jnp's abs and max compiled once per leaf shape.)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert np.abs(np.asarray(a, np.float32)).max() > 0 and rel_err(b, a) < 2e-2
    L, K, G, H, D = (
        CFG.num_layers,
        CFG.num_kv_heads,
        CFG.num_heads // CFG.num_kv_heads,
        CFG.num_heads,
        CFG.head_dim,
    )
    jax.ad_checkpoint.print_saved_residuals(lambda p: loss(p, g_remat), params)
    printed = capsys.readouterr().out
    kept = [(L, 2, K, G, 12, D)]  # the attention output
    if policy == "matmuls":  # q, k / v, gate / up
        kept += [(L, 2, 12, H, D), (L, 2, 12, K, D), (L, 2, 12, CFG.intermediate_size)]
    for shape in kept:
        assert f"u16[{','.join(map(str, shape))}] output of scan" in printed, printed
        assert f"bf16[{','.join(map(str, shape))}] output of scan" not in printed, printed
    if tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 11):
        # jax 0.11's scan stacks each layer's bf16 input [L, B, T, E] itself (the kept values
        # above are still bit patterns); the CPU pin, 0.10.2, has no bf16 stack at all.
        return
    hlo = grad.lower(params, g_remat).compile().as_text()
    stacked = [
        line
        for line in hlo.splitlines()
        if " dynamic-update-slice(" in line and f"bf16[{L}," in line.split("=")[1][:20]
    ]
    assert not stacked, stacked


def test_bf16_compute_with_f32_params(model):
    """bf16 activations (params cast per layer): logits f32, within 5% of f32 compute (bf16
    keeps 8 mantissa bits, ~0.4% per rounding; measured ~1% after 2 layers)."""
    graphdef, params = model
    g16, _ = decoder.abstract_init(dataclasses.replace(CFG, compute_dtype="bfloat16"))
    tokens = np.random.default_rng(4).integers(0, CFG.vocab_size, (2, 8))
    ref = forward_2x8(graphdef, params, tokens)
    low = forward_2x8(g16, params, tokens)
    assert low.dtype == jnp.float32
    assert 0 < rel_err(low, ref) < 5e-2


def test_config_hf_round_trip():
    assert config_json.from_hf(config_json.to_hf(CFG), attention_bias=True, qk_norm=True) == CFG
    tied = dataclasses.replace(CFG, model_type="qwen2", qk_norm=False, tie_word_embeddings=True)
    assert config_json.from_hf(config_json.to_hf(tied)) == tied


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_values_and_grads_accumulate_in_f32(dtype):
    """`_dense` (f32 accumulation, rounded once to the compute dtype) gives the f64 product
    and the input gradient within one rounding of inputs and output, elementwise and relative
    to the magnitudes summed; the weight gradient within twice that (see the bound below)."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 5, 3, 8)), dtype)  # [B, T, H, D], n_in = 2
    w = jnp.asarray(rng.standard_normal((3, 8, 12)), dtype)
    g = rng.standard_normal((2, 5, 12))

    def loss(x, w):
        return jnp.sum(block.dense(x, w, 2).astype(jnp.float32) * g)

    value, (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    x64, w64 = np.asarray(x, np.float64).reshape(10, 24), np.asarray(w, np.float64).reshape(24, 12)
    g64 = g.reshape(10, 12)
    # One rounding is half a unit in the last place: 2^-9 relative for bf16 (8 mantissa bits).
    # Forward: the f32-accumulated product is rounded once, so |y - exact| <= 2^-9 |exact|
    # elementwise. Backward: the cotangent g is rounded once to the compute dtype (the astype's
    # transpose), then the f32-accumulated product is rounded once, so each gradient entry is
    # off by at most 2^-9 of the sum of |terms| (the input rounding) plus 2^-9 of its own size
    # (the output rounding): <= 2^-8 * (|g| @ |w|^T). The bound is per element and relative
    # to the magnitudes involved; a bf16 accumulation or a second rounding exceeds it.
    # dw is allowed twice that: measured 1.13 x 2^-8 of its sum of |terms| on XLA:CPU (dx:
    # 0.67 x, value: 0.05 x), so its backward matmul rounds once more somewhere; a bf16
    # accumulation over the 10 rows would still exceed 2 x 2^-8.
    # f32 has 24 bits; 2^-18 leaves room for the f32 accumulation order over 24 terms.
    u = 2.0**-8 if dtype == "bfloat16" else 2.0**-18
    y64 = x64 @ w64
    assert abs(float(value) - np.sum(y64 * g64)) <= u * np.sum(np.abs(y64 * g64))
    dx64 = np.asarray(dx, np.float64).reshape(10, 24)
    dw64 = np.asarray(dw, np.float64).reshape(24, 12)
    assert np.all(np.abs(dx64 - g64 @ w64.T) <= u * (np.abs(g64) @ np.abs(w64).T))
    assert np.all(np.abs(dw64 - x64.T @ g64) <= 2 * u * (np.abs(x64).T @ np.abs(g64)))
