"""Episodes in the sampler: a turn parks with its KV pages, the environment's observation is
appended, and decoding goes on without recomputing the cache.

Greedy decoding is a function of the context alone, so a resumed episode's new tokens must be
the argmax of one teacher-forced forward over its whole context (prompt, first turn,
observation, new tokens), with the same logprobs, while prefilling only the observation (and the turn's last token). Checked with
several episodes at once, with the pool so small that parked caches are evicted and recomputed,
under both kv policies, and for the bad observations that end an episode.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import models
from pipelinerl_jax.models import decoder
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.sequence import SamplingParams

CONFIG = SamplerConfig(num_slots=4, max_seq_len=96, page_size=8, num_pages=24, chunk_steps=4)
TURN = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def model():
    cfg, graphdef, params = models.tiny("llama", seed=3, vocab_size=96)
    return cfg, graphdef, params


def _run(sampler):
    out = []
    while sampler.has_work():
        out.extend(sampler.step())
    return out


def _check_greedy(model, context, new_tokens, new_logprobs):
    """The tokens decoded after `context` are the greedy ones, as one teacher-forced forward
    over the whole sequence computes them, with the same logprobs."""
    _, graphdef, params = model
    tokens = list(context) + list(new_tokens)
    logits = decoder.jit_forward(
        graphdef, params, jnp.asarray([tokens]), jnp.arange(len(tokens))[None]
    )
    lp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
    rows = lp[len(context) - 1 : len(tokens) - 1]
    assert [int(t) for t in jnp.argmax(rows, axis=-1)] == list(new_tokens)
    picked = np.asarray(rows)[np.arange(len(new_tokens)), new_tokens]
    np.testing.assert_allclose(new_logprobs, picked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_policy", ["keep", "recompute"])
def test_resumed_episodes_continue_as_a_fresh_request_would(model, kv_policy):
    _, graphdef, params = model
    config = dataclasses.replace(CONFIG, kv_policy=kv_policy)
    sampler = PagedSampler(graphdef, params, config)
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, 96, n)) for n in (5, 11)]
    for prompt in prompts:
        sampler.submit(prompt, n=2, params=TURN, episode=True)
    first = _run(sampler)
    assert len(first) == 4 and sampler.num_parked == 4
    sampler.scheduler.check()
    observations = {}
    for s in first:
        observations[(s.request_id, s.attempt)] = list(rng.integers(0, 96, 3 + s.attempt))
        if kv_policy == "recompute":  # a swap (same weights) drops parked caches
            sampler.set_params(params, version=1)
        before = sampler.stats["prefill_tokens"]
        sampler.resume(
            s.request_id, s.attempt, observations[(s.request_id, s.attempt)], max_new_tokens=5
        )
        second = _run(sampler)
        assert len(second) == 1 and second[0].finish_reason in ("stop", "length")
        resumed = second[0]
        obs = observations[(s.request_id, s.attempt)]
        # The turn's last token and the observation but its last are prefilled, nothing else.
        prefilled = sampler.stats["prefill_tokens"] - before
        if kv_policy == "keep":
            assert prefilled == len(obs)
        else:
            assert prefilled == len(s.prompt_ids) + len(s.token_ids) + len(obs) - 1
        n_turn = len(s.token_ids)
        assert resumed.token_ids[:n_turn] == s.token_ids
        assert resumed.token_ids[n_turn : n_turn + len(obs)] == obs
        new = slice(n_turn + len(obs), None)
        _check_greedy(
            model, s.prompt_ids + s.token_ids + obs, resumed.token_ids[new], resumed.logprobs[new]
        )
        assert resumed.versions[n_turn : n_turn + len(obs)] == [-1] * len(obs)
        assert resumed.logprobs[n_turn : n_turn + len(obs)] == [0.0] * len(obs)
        assert min(resumed.versions[n_turn + len(obs) :]) >= 0
        sampler.release(s.request_id, s.attempt)
        sampler.scheduler.check()
    assert sampler.num_parked == 0
    assert all(a.num_free == a.num_pages - 1 for a in sampler.scheduler.allocators)


def test_a_full_pool_evicts_parked_caches_and_they_are_recomputed(model):
    _, graphdef, params = model
    small = dataclasses.replace(CONFIG, num_slots=2, num_pages=7)
    sampler = PagedSampler(graphdef, params, small)
    rng = np.random.default_rng(8)
    parked = list(rng.integers(0, 96, 9))
    sampler.submit(parked, params=TURN, episode=True)
    (turn,) = _run(sampler)
    # Two long plain requests need the parked episode's pages.
    for _ in range(2):
        sampler.submit(
            list(rng.integers(0, 96, 14)), params=dataclasses.replace(TURN, max_new_tokens=8)
        )
    _run(sampler)
    assert sampler.scheduler.evictions >= 1
    sampler.scheduler.check()
    obs = list(rng.integers(0, 96, 4))
    sampler.resume(turn.request_id, turn.attempt, obs, max_new_tokens=5)
    (resumed,) = _run(sampler)
    new = slice(len(turn.token_ids) + len(obs), None)
    context = turn.prompt_ids + turn.token_ids + obs
    _check_greedy(model, context, resumed.token_ids[new], resumed.logprobs[new])
    sampler.release(turn.request_id, turn.attempt)
    sampler.scheduler.check()


def test_bad_observations_end_the_episode_with_an_error(model):
    _, graphdef, params = model
    sampler = PagedSampler(graphdef, params, CONFIG)
    for _ in range(3):
        sampler.submit([1, 2, 3], params=TURN, episode=True)
    done = _run(sampler)
    cases = [([], "empty observation"), ([500], "outside the vocabulary"), ([1] * 95, "no room")]
    for s, (obs, why) in zip(done, cases, strict=True):
        sampler.resume(s.request_id, s.attempt, obs, max_new_tokens=4)
        (err,) = sampler.step()
        assert err.finish_reason == "error" and why in err.error
    assert sampler.num_parked == 0
    with pytest.raises(KeyError, match="is not parked"):
        sampler.resume(done[0].request_id, 0, [1], max_new_tokens=2)
    sampler.scheduler.check()
