"""The Gemma family end to end against transformers' GemmaForCausalLM (tiny random checkpoint).

Gemma differs from Llama in math only ((1 + w) norms in f32, tanh GELU, sqrt(E)-scaled
embeddings, tied head, head_dim != E / H); test_hf_io.py checks its logits and round trip.
Here: the sampler (every decode attention strategy, hence both block layouts) generates what
transformers' greedy `generate` does, with its logprobs, and the gradient of the sequence
log-likelihood through our forward equals torch autograd's for an embedding, a norm and a
projection weight. Norm weights are randomised so a missing "1 +" would show.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pipelinerl_jax.models import decoder, hf_io
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.sequence import SamplingParams
from tests.tiny_models import hf_greedy

VOCAB, MAX_NEW = 96, 10
CONFIG = SamplerConfig(
    num_slots=4, max_seq_len=40, page_size=8, chunk_steps=4, prefill_chunk=16, max_prefill_rows=4
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma")
    config = transformers.GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
    )
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    cfg, graphdef, params = hf_io.load_hf(path)
    assert cfg.model_type == "gemma" and cfg.tie_word_embeddings and cfg.head_dim == 16
    return model, graphdef, params


@pytest.mark.parametrize("attention", ["staged", "paged", "gather"])
def test_greedy_generation_matches_transformers(gemma, attention):
    model, graphdef, params = gemma
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 19, 2)]
    sampler = PagedSampler(graphdef, params, dataclasses.replace(CONFIG, attention=attention))
    samples = sampler.generate(
        prompts, params=SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    )
    for prompt, sample in zip(prompts, samples):
        want_tokens, want_logprobs, _ = hf_greedy(model, prompt, MAX_NEW)
        assert sample.token_ids == want_tokens
        np.testing.assert_allclose(sample.logprobs, want_logprobs, atol=2e-5, rtol=1e-4)


def test_log_likelihood_gradient_matches_torch_autograd(gemma):
    model, graphdef, params = gemma
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, VOCAB, (2, 12))
    positions = np.broadcast_to(np.arange(12), (2, 12))

    def log_likelihood(p):
        logits = decoder.forward(graphdef, p, jnp.asarray(tokens), jnp.asarray(positions))
        logprobs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return jnp.take_along_axis(logprobs, jnp.asarray(tokens)[:, 1:, None], -1).sum()

    ours = decoder.arrays(jax.jit(jax.grad(log_likelihood))(params))
    model.zero_grad()
    logits_t = model(torch.tensor(tokens)).logits.float()
    logprobs_t = torch.log_softmax(logits_t[:, :-1], -1)
    logprobs_t.gather(-1, torch.tensor(tokens)[:, 1:, None]).sum().backward()
    layer = model.model.layers[1]
    e, h, d = 32, 4, 16
    pairs = {
        "embed": (ours["embed"], model.model.embed_tokens.weight.grad),
        "final_norm": (ours["final_norm"], model.model.norm.weight.grad),
        "attn_norm": (ours["layers"]["attn_norm"][1], layer.input_layernorm.weight.grad),
        # HF q_proj is [H*D, E]; ours [E, H, D].
        "q_proj": (
            ours["layers"]["q_proj"][1].reshape(e, h * d).T,
            layer.self_attn.q_proj.weight.grad,
        ),
        "down_proj": (ours["layers"]["down_proj"][1].T, layer.mlp.down_proj.weight.grad),
    }
    for name, (got, want) in pairs.items():
        want = want.numpy()
        scale = np.abs(want).max()
        assert scale > 0, name
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4 * scale, rtol=0, err_msg=name)
