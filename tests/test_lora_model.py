"""LoRA in the model (models/lora.py): the adapter rows, their init, the forward with them, the
merge, the config's refusals, and the compositions a user writes (grad of jit, checkpoint)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, lora, tiny_config

ALL = ["q", "k", "v", "o", "gate", "up", "down"]


def _model(model_type="llama", targets=ALL, rank=4, alpha=8.0, seed=0):
    cfg = tiny_config(model_type, lora={"rank": rank, "alpha": alpha, "targets": targets})
    graphdef, params = decoder.init(cfg, jax.random.key(seed))
    return cfg, graphdef, params


def _inputs(cfg, rows=2, length=9, seed=1):
    tokens = jax.random.randint(jax.random.key(seed), (rows, length), 0, cfg.vocab_size)
    return tokens, jnp.broadcast_to(jnp.arange(length), (rows, length))


def _random_adapters(params, seed=2, std=0.05):
    adapters, base = lora.split(decoder.arrays(params))
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    fresh = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(tree, fresh), base


def test_adapter_rows_shapes_and_init():
    cfg, _, params = _model(rank=4)
    layers = decoder.arrays(params)["layers"]
    L, E, H, K, D, F = 2, 32, 4, 2, 8, 64
    want = {
        "q_proj_lora_a": (L, E, 4),
        "q_proj_lora_b": (L, 4, H, D),
        "k_proj_lora_b": (L, 4, K, D),
        "o_proj_lora_a": (L, H, D, 4),
        "o_proj_lora_b": (L, 4, E),
        "down_proj_lora_a": (L, F, 4),
        "down_proj_lora_b": (L, 4, E),
    }
    for name, shape in want.items():
        assert layers[name].shape == shape, name
    for target in lora.TARGETS:
        assert not np.any(np.asarray(layers[target + "_lora_b"]))  # B starts at zero
        a = np.asarray(layers[target + "_lora_a"])
        fan_in = np.prod(a.shape[1:-1])
        assert np.abs(a).max() <= 1 / np.sqrt(fan_in) and a.std() > 0.3 / np.sqrt(fan_in)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma"])
def test_zero_b_is_exactly_the_base_model(model_type):
    cfg, graphdef, params = _model(model_type)
    base_cfg = dataclasses.replace(cfg, lora=None)
    base_graphdef, base_params = decoder.init(base_cfg, jax.random.key(0))
    _, base = lora.split(decoder.arrays(params))
    # The adapters draw from their own key: the base weights are those of the plain model.
    jax.tree.map(np.testing.assert_array_equal, base, decoder.arrays(base_params))
    tokens, positions = _inputs(cfg)
    # x·W + 0 is x·W, but the extra add may change how XLA fuses what follows (Qwen3's qk-norm
    # reduction), so the comparison allows the last float bit.
    np.testing.assert_allclose(
        decoder.forward(graphdef, params, tokens, positions),
        decoder.forward(base_graphdef, base_params, tokens, positions),
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.parametrize("targets", [ALL, ["q", "v"], ["o", "down"]])
def test_lora_forward_equals_the_merged_model(targets):
    cfg, graphdef, params = _model(targets=targets, rank=3, alpha=7.0)
    adapters, base = _random_adapters(params)
    tokens, positions = _inputs(cfg)
    got = decoder.forward(graphdef, lora.merge(adapters, base), tokens, positions)
    merged = lora.merged_weights(lora.merge(adapters, base), cfg.lora)
    assert set(merged["layers"]) == set(base["layers"])
    base_graphdef, _ = decoder.abstract_init(dataclasses.replace(cfg, lora=None))
    want = decoder.forward(base_graphdef, merged, tokens, positions)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    plain = decoder.forward(base_graphdef, base, tokens, positions)
    assert float(jnp.abs(got - plain).max()) > 1e-2  # the adapters do change the model


def test_lora_term_by_hand():
    """One projection's LoRA term against numpy: x W + alpha / r (x A) B."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 6)).astype(np.float32)
    w, a, b = (rng.standard_normal(s).astype(np.float32) for s in ((6, 4), (6, 2), (2, 4)))
    from pipelinerl_jax.models import block

    lp = {"p": w, "p_lora_a": a, "p_lora_b": b}
    got = lora.adapted(block.TOKEN_MAJOR, jnp.asarray(x), lp, "p", 1, 2.5)
    np.testing.assert_allclose(got, x @ w + 2.5 * (x @ a) @ b, rtol=1e-5, atol=1e-5)


def test_grad_of_jit_reaches_adapters_and_matches_finite_differences():
    cfg, graphdef, params = _model(targets=["q", "up"], rank=2)
    adapters, base = _random_adapters(params)
    tokens, positions = _inputs(cfg)

    @jax.jit
    def loss(adapters):
        logits = decoder.forward(graphdef, lora.merge(adapters, base), tokens, positions)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grads = jax.grad(loss)(adapters)
    g = grads["layers"]["up_proj_lora_b"]
    assert float(jnp.abs(g).max()) > 0
    direction = jax.tree.map(lambda x: jnp.zeros_like(x), adapters)
    direction["layers"]["up_proj_lora_b"] = jnp.sign(g)
    eps = 1e-3
    step = lambda s: jax.tree.map(lambda x, d: x + s * d, adapters, direction)  # noqa: E731
    numeric = (loss(step(eps)) - loss(step(-eps))) / (2 * eps)
    np.testing.assert_allclose(numeric, jnp.sum(jnp.abs(g)), rtol=2e-2)


def test_rematerialised_forward_gives_the_same_gradients():
    cfg, graphdef, params = _model(targets=["v", "o", "down"])
    adapters, base = _random_adapters(params)
    tokens, positions = _inputs(cfg)
    remat_graphdef, _ = decoder.abstract_init(
        dataclasses.replace(cfg, remat=True, remat_policy="matmuls")
    )

    def loss(graphdef, adapters):
        logits = decoder.forward(graphdef, lora.merge(adapters, base), tokens, positions)
        return jnp.mean(logits**2)

    plain = jax.grad(lambda a: loss(graphdef, a))(adapters)
    remat = jax.jit(jax.grad(lambda a: loss(remat_graphdef, a)))(adapters)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), plain, remat)


def test_split_and_merge_are_inverse():
    _, _, params = _model()
    tree = decoder.arrays(params)
    adapters, base = lora.split(tree)
    assert all(lora.is_adapter(k) for k in adapters["layers"])
    assert not any(lora.is_adapter(k) for k in base["layers"])
    assert set(base) == set(tree)
    jax.tree.map(np.testing.assert_array_equal, lora.merge(adapters, base), tree)


def test_config_round_trips_through_json():
    from pipelinerl_jax.train.json_items import model_config_from_json, model_config_to_json

    cfg = tiny_config(lora={"rank": 8, "alpha": 16, "targets": ["q_proj", "v"]})
    assert cfg.lora == lora.LoraConfig(8, 16.0, ("q_proj", "v_proj"))
    assert cfg.lora.scale == 2.0
    back = model_config_from_json(model_config_to_json(cfg))
    assert back == cfg and hash(back) == hash(cfg)


@pytest.mark.parametrize(
    "value, words",
    [
        ({"rank": -1}, "rank=-1"),
        ({"rank": 4.5}, "rank=4.5"),
        ({"alpha": -1}, "alpha=-1"),
        ({"targets": ["q", "lm_head"]}, "'lm_head' is not a projection"),
        ({"targets": "q"}, "give a list"),
        ({"targets": []}, "targets is empty"),
        ({"targets": ["q", "q_proj"]}, "names one twice"),
        ({"ranks": 4}, "unknown keys ['ranks']"),
        ({"rank": 4, "alpha": float("inf")}, "alpha=inf: use a positive finite number"),
        ({"rank": 0, "alpha": 8}, "alpha set without a rank"),
        ({"rank": 0, "targets": ["q"], "alpha": 1}, "alpha and targets set without a rank"),
        ({"rank": 10**6}, "model.lora rank=1000000 exceeds q_proj's"),
        (16, "give a dict"),
    ],
)
def test_bad_lora_config_is_one_line(value, words):
    with pytest.raises(ConfigError) as err:
        tiny_config(lora=value)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_rank_zero_or_nothing_means_no_adapters():
    """The run config's own lora section (rank 0, default alpha and targets) means no LoRA;
    rank 0 beside another alpha or targets is refused (above), not a silent full fine-tune."""
    off = {"rank": 0, "alpha": 32.0, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
    for value in (None, {}, off):
        assert tiny_config(lora=value).lora is None
    smallest = min(min(io) for io in tiny_config().projection_features.values())
    assert tiny_config(lora={"rank": smallest}).lora.rank == smallest
