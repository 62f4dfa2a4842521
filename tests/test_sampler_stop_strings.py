"""Stop strings: a turn ends at the first token whose text completes one of them, however the
tokenizer split it, and an episode cut there resumes on its pages as if the tokens decoded
past the cut (in the same chunk) had never been.

The detokenizer maps each id to a fixed string of 1-3 letters, so a stop string can span a
token boundary. Greedy decoding makes the uncut output a reference: the cut output must be
its prefix, ending at the first token whose prefix text contains the stop string.
"""

import dataclasses

import numpy as np
import pytest

from pipelinerl_jax import models
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.scheduler import SamplingParams
from tests.test_sampler_episodes import _check_greedy, _run

CONFIG = SamplerConfig(num_slots=4, max_seq_len=96, page_size=8, num_pages=24, chunk_steps=4)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
rng = np.random.default_rng(11)
WORDS = ["".join(rng.choice(list("abcdef"), size=int(rng.integers(1, 4)))) for _ in range(96)]


def detok(ids):
    return "".join(WORDS[i] for i in ids)


@pytest.fixture(scope="module")
def model():
    return models.tiny("llama", seed=3, vocab_size=96)


def _cut_point(tokens, stop):
    """The length of the shortest prefix whose text contains `stop`."""
    return next(j for j in range(1, len(tokens) + 1) if stop in detok(tokens[:j]))


def _spanning_stop(tokens, at):
    """A stop string made of the end of token `at` and the start of token `at` + 1."""
    return WORDS[tokens[at]][-1] + WORDS[tokens[at + 1]][0]


@pytest.mark.parametrize("kv_policy", ["keep", "recompute"])
def test_a_turn_ends_at_the_first_token_completing_a_stop_string(model, kv_policy):
    _, graphdef, params = model
    config = dataclasses.replace(CONFIG, kv_policy=kv_policy)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 96, 7)]
    (free,) = PagedSampler(graphdef, params, config, detokenize=detok).generate(
        [prompt], params=GREEDY
    )
    assert len(free.token_ids) == GREEDY.max_new_tokens  # no EOS: the whole budget
    # Stops completed mid-chunk (token 5: chunk 2, step 2) and by a chunk's last token (7).
    for at in (4, 6):
        stop = _spanning_stop(free.token_ids, at)
        cut = _cut_point(free.token_ids, stop)
        assert cut <= at + 2
        sampler = PagedSampler(graphdef, params, config, detokenize=detok)
        (s,) = sampler.generate([prompt], params=dataclasses.replace(GREEDY, stop_strings=(stop,)))
        assert s.finish_reason == "stop"
        assert s.token_ids == free.token_ids[:cut]
        assert s.logprobs == free.logprobs[:cut] and s.versions == free.versions[:cut]
        sampler.scheduler.check()


def test_an_episode_cut_by_a_stop_string_resumes_on_its_pages(model):
    _, graphdef, params = model
    prompt = [int(t) for t in np.random.default_rng(6).integers(0, 96, 9)]
    (free,) = PagedSampler(graphdef, params, CONFIG, detokenize=detok).generate(
        [prompt], params=GREEDY
    )
    stop = _spanning_stop(free.token_ids, 5)
    cut = _cut_point(free.token_ids, stop)
    sampler = PagedSampler(graphdef, params, CONFIG, detokenize=detok)
    turn_params = dataclasses.replace(GREEDY, stop_strings=(stop,))
    sampler.submit(prompt, params=turn_params, episode=True)
    (turn,) = _run(sampler)
    assert turn.token_ids == free.token_ids[:cut] and sampler.num_parked == 1
    # The observation holds the stop string itself: only the new turn's text counts.
    obs = [free.token_ids[5], free.token_ids[6], 3, 17]
    sampler.resume(turn.request_id, turn.attempt, obs, max_new_tokens=8)
    (resumed,) = _run(sampler)
    new = resumed.token_ids[len(turn.token_ids) + len(obs) :]
    assert stop not in detok(new[:-1])  # it ended at its first stop, or at the budget
    # Greedy over the whole context: the K/V the device wrote past the cut never leaked.
    _check_greedy(
        model,
        prompt + turn.token_ids + obs,
        new,
        resumed.logprobs[len(turn.token_ids) + len(obs) :],
    )
    sampler.release(turn.request_id, turn.attempt)
    sampler.scheduler.check()
    assert all(a.num_free == a.num_pages - 1 for a in sampler.scheduler.allocators)


def test_bad_stop_strings_are_error_samples(model):
    _, graphdef, params = model
    no_text = PagedSampler(graphdef, params, CONFIG)
    no_text.submit([1, 2, 3], params=dataclasses.replace(GREEDY, stop_strings=("ab",)))
    (err,) = no_text.step()
    assert err.finish_reason == "error" and "detokenize" in err.error
    sampler = PagedSampler(graphdef, params, CONFIG, detokenize=detok)
    sampler.submit([1, 2, 3], params=dataclasses.replace(GREEDY, stop_strings=("",)))
    (err,) = sampler.step()
    assert err.finish_reason == "error" and "non-empty strings" in err.error
