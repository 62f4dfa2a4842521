"""The sampler with LoRA: decoding base + adapters gives the trainer's logprobs at equal
version, in both layouts; a swap takes the adapters alone, moves only their bytes and never
recompiles; bad adapters are refused in one line."""

import jax
import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, lora
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.sequence import SamplingParams
from tests.tiny_models import model_config

LORA = {"rank": 4, "alpha": 8, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
PROMPTS = [[3, 17, 5, 9], [40, 2], [8, 8, 31, 60, 12, 7, 1]]


def _random_adapters(params, seed, std=0.1):
    adapters, _ = lora.split(decoder.arrays(params))
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    )


def _model_logprobs(graphdef, params, sample):
    """The trainer's view: teacher-forced log_softmax of the full model at the sampled tokens."""
    ids = np.asarray(sample.prompt_ids + sample.token_ids)[None]
    positions = np.arange(ids.shape[1])[None]
    logits = decoder.jit_forward(graphdef, params, ids, positions)
    lp = jax.nn.log_softmax(logits[0], axis=-1)
    p = len(sample.prompt_ids)
    return np.asarray(lp[np.arange(p - 1, ids.shape[1] - 1), ids[0, p:]])


@pytest.fixture(scope="module")
def model():
    cfg = model_config(vocab_size=64, lora=LORA)
    graphdef, params = decoder.init(cfg, jax.random.key(7))
    _, base = lora.split(decoder.arrays(params))
    return cfg, graphdef, lora.merge(_random_adapters(params, 1), base)


@pytest.mark.parametrize("attention", ["staged", "paged"])
def test_sampler_logprobs_equal_the_model_and_a_swap_moves_adapters_only(model, attention):
    cfg, graphdef, params = model
    scfg = SamplerConfig(
        num_slots=4, max_seq_len=32, page_size=8, chunk_steps=4, attention=attention
    )
    sampler = PagedSampler(graphdef, params, scfg)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    for sample in sampler.generate(PROMPTS, params=sp):
        np.testing.assert_allclose(
            sample.logprobs, _model_logprobs(graphdef, params, sample), atol=2e-5
        )
    adapters = _random_adapters(params, 2)
    _, base = lora.split(decoder.arrays(params))
    compiled = sampler.engine.decode_chunk._cache_size()
    sampler.set_params(sampler.prepare(adapters), 1, prepared=True)
    assert sampler._view.last_bytes == sum(x.nbytes for x in jax.tree.leaves(adapters))
    assert sampler._view.last_bytes < sum(x.nbytes for x in jax.tree.leaves(base)) / 4
    new_params = lora.merge(adapters, base)
    for sample in sampler.generate(PROMPTS, params=sp):
        assert set(sample.versions) == {1}
        np.testing.assert_allclose(
            sample.logprobs, _model_logprobs(graphdef, new_params, sample), atol=2e-5
        )
    assert sampler.engine.decode_chunk._cache_size() == compiled  # the swap did not recompile


def test_bad_adapters_are_refused(model):
    cfg, graphdef, params = model
    sampler = PagedSampler(graphdef, params, SamplerConfig(num_slots=2, max_seq_len=16))
    adapters = _random_adapters(params, 3)
    adapters["layers"]["q_proj_lora_a"] = adapters["layers"]["q_proj_lora_a"][..., :2]
    with pytest.raises(ConfigError, match="same model.lora rank and targets"):
        sampler.prepare(adapters)


def test_a_second_sampler_shares_the_first_ones_base(model):
    cfg, graphdef, params = model
    scfg = SamplerConfig(num_slots=4, max_seq_len=32, page_size=8, chunk_steps=4)
    first = PagedSampler(graphdef, params, scfg)
    adapters = _random_adapters(params, 4)
    second = PagedSampler(graphdef, adapters, scfg, version=3, share_base=first)
    assert second._view.last_bytes == sum(x.nbytes for x in jax.tree.leaves(adapters))
    # The same base arrays, not a copy of them.
    assert second.params["layers"][0]["q_proj"] is first.params["layers"][0]["q_proj"]
    _, base = lora.split(decoder.arrays(params))
    sp = SamplingParams(temperature=1.0, max_new_tokens=5)
    for sample in second.generate(PROMPTS, params=sp):
        np.testing.assert_allclose(
            sample.logprobs,
            _model_logprobs(graphdef, lora.merge(adapters, base), sample),
            atol=2e-5,
        )
    plain = PagedSampler(graphdef, params, scfg)
    with pytest.raises(ConfigError, match="needs a LoRA model"):
        PagedSampler(
            decoder.abstract_init(model_config(vocab_size=64))[0],
            params,
            scfg,
            share_base=plain,
        )
