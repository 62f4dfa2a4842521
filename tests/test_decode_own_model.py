"""A model of the researcher's own, decoded over our paged KV cache through `apply=`.

The model below is a small Flax NNX decoder written here, knowing nothing of the package but
the attend hook: its layers attend over their own keys when called plainly, and through the
engine's `attend` when decoded. Greedy decoding through prefill + decode_chunk, under each
decode strategy, gives exactly the tokens of recomputing the whole sequence with
the plain model (each token its argmax in one teacher-forced forward), and the engine's
logprobs are the plain model's log-softmax at those tokens.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax.sampler import steps


@dataclasses.dataclass(frozen=True)
class Sizes:  # what the engine reads of a model: cache shape and vocabulary
    vocab_size: int = 48
    hidden: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8


class Layer(nnx.Module):
    def __init__(self, s: Sizes, rngs: nnx.Rngs):
        self.s = s
        self.q = nnx.Linear(s.hidden, s.num_heads * s.head_dim, rngs=rngs)
        self.k = nnx.Linear(s.hidden, s.num_kv_heads * s.head_dim, rngs=rngs)
        self.v = nnx.Linear(s.hidden, s.num_kv_heads * s.head_dim, rngs=rngs)
        self.o = nnx.Linear(s.num_heads * s.head_dim, s.hidden, rngs=rngs)
        self.up = nnx.Linear(s.hidden, 2 * s.hidden, rngs=rngs)
        self.down = nnx.Linear(2 * s.hidden, s.hidden, rngs=rngs)
        self.norm1, self.norm2 = (
            nnx.LayerNorm(s.hidden, rngs=rngs),
            nnx.LayerNorm(s.hidden, rngs=rngs),
        )

    def __call__(self, x_BxTxE, layer, attend, carry):
        s = self.s
        b, t, _ = x_BxTxE.shape
        h = self.norm1(x_BxTxE)
        q = self.q(h).reshape(b, t, s.num_heads, s.head_dim)
        k = self.k(h).reshape(b, t, s.num_kv_heads, s.head_dim)
        v = self.v(h).reshape(b, t, s.num_kv_heads, s.head_dim)
        if attend is None:  # plain causal attention over this call's own tokens
            g = s.num_heads // s.num_kv_heads
            k_r, v_r = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k_r) / np.sqrt(s.head_dim)
            scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
            out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v_r)
        else:
            out, (_, carry) = attend(q, k, v, (layer, carry))
        x_BxTxE = x_BxTxE + self.o(out.reshape(b, t, -1))
        return x_BxTxE + self.down(jax.nn.gelu(self.up(self.norm2(x_BxTxE)))), carry


class TinyLM(nnx.Module):
    def __init__(self, s: Sizes, rngs: nnx.Rngs):
        self.embed = nnx.Embed(s.vocab_size, s.hidden, rngs=rngs)
        self.position = nnx.Embed(64, s.hidden, rngs=rngs)
        self.layers = nnx.List([Layer(s, rngs) for _ in range(s.num_layers)])
        self.head = nnx.Linear(s.hidden, s.vocab_size, rngs=rngs)

    def __call__(self, tokens_BxT, positions_BxT, attend=None, carry=None):
        x = self.embed(tokens_BxT) + self.position(positions_BxT)
        for layer, block in enumerate(self.layers):
            x, carry = block(x, layer, attend, carry)
        return self.head(x), carry


def _check_greedy(model, prompt, tokens, logprobs):
    """Each decoded token is the plain model's argmax over its whole context, recomputed in one
    causal forward (teacher forcing), with the same log-probability."""
    context = list(prompt) + list(tokens)
    logits, _ = model(jnp.asarray([context]), jnp.arange(len(context))[None])
    lp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
    for i, token in enumerate(tokens):
        row = lp[len(prompt) - 1 + i]
        assert int(jnp.argmax(row)) == token, (i, context)
        np.testing.assert_allclose(float(row[token]), logprobs[i], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ["staged", "paged", "gather"])
def test_own_flax_model_decodes_over_the_paged_cache(attention):
    sizes = Sizes()
    model = TinyLM(sizes, nnx.Rngs(7))
    graphdef, params = nnx.split(model)

    def apply(params, tokens_BxT, positions_BxT, attend, carry):
        return nnx.merge(graphdef, params)(tokens_BxT, positions_BxT, attend, carry)

    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, sizes.vocab_size, n)) for n in (5, 9, 2)]
    ecfg = steps.EngineConfig(
        num_slots=4,
        page_size=4,
        num_pages=24,
        pages_per_slot=6,
        max_stop_tokens=2,
        attention=attention,
    )
    n_steps = 8
    state = steps.state_from_prompts(
        params,
        prompts,
        cfg=sizes,
        ecfg=ecfg,
        chunk_steps=n_steps,
        max_new_tokens=n_steps,
        apply=apply,
    )
    decode = jax.jit(
        functools.partial(
            steps.decode_chunk, cfg=sizes, ecfg=ecfg, k=n_steps, window=6, apply=apply
        )
    )
    state = decode(params, state, 3)
    tokens, logprobs = np.asarray(state.out_tokens), np.asarray(state.out_logprobs)
    assert np.asarray(state.out_versions)[: len(prompts)].tolist() == [[3] * n_steps] * 3
    for b, prompt in enumerate(prompts):
        _check_greedy(model, prompt, tokens[b].tolist(), logprobs[b])


def test_own_model_with_tensor_parallel_axes_is_refused():
    with pytest.raises(ValueError, match="tensor parallelism needs the built-in families"):
        steps.decode_chunk(
            {},
            None,
            0,
            cfg=Sizes(),
            ecfg=None,
            k=1,
            window=1,
            axes=steps.MeshAxes(tp="tp"),
            apply=lambda *a: a,
        )
