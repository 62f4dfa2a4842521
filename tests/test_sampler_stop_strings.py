"""Stop strings in the paged sampler: a turn ends at the first token whose text completes a
stop string the caller named, even where the string spans tokens.

Each token id decodes to a fixed 1-3 character word, so a stop string made of the end of one
word and the next is completed by exactly one token, known in advance. Checked: the cut
output is the uncut greedy output's prefix (tokens, logprobs, versions) whether the string is
completed at a chunk's end or in its middle, and when the device stopped the sequence later in
the same chunk; under both kv policies. An episode cut this way parks holding only the pages
its cache needs, and its next turn is the greedy continuation of prompt + cut turn +
observation (one teacher-forced forward computes it): the K/V the device wrote past the cut
never leaks into it. Only the current turn's text counts: a stop string inside the observation
or across the observation/turn boundary does not end the next turn. Bad requests come back
as error samples.
"""

import dataclasses
import json
import string

import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import models
from pipelinerl_jax.distributed.remote_sampler import params_from_json
from pipelinerl_jax.models import decoder
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.pages import pages_for
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.sequence import SamplingParams
from pipelinerl_jax.sampler.stop_strings import stop_string_cut
from tests.test_sampler_episodes import _check_greedy

VOCAB = 96
_letters = np.random.default_rng(0)
WORDS = ["".join(_letters.choice(list(string.ascii_letters), 1 + i % 3)) for i in range(VOCAB)]
CONFIG = SamplerConfig(num_slots=4, max_seq_len=96, page_size=8, num_pages=24, chunk_steps=4)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


def text(ids) -> str:
    return "".join(WORDS[int(i)] for i in ids)


@pytest.fixture(scope="module")
def model():
    return models.tiny("llama", seed=3, vocab_size=VOCAB)


def _sampler(model, kv_policy="keep", detokenize=text):
    _, graphdef, params = model
    config = dataclasses.replace(CONFIG, kv_policy=kv_policy)
    return PagedSampler(graphdef, params, config, detokenize=detokenize)


def _run(sampler):
    out = []
    while sampler.has_work():
        out.extend(sampler.step())
    return out


def _first_keep(turn, stops) -> int | None:
    """Brute force: the fewest tokens of `turn` whose text holds a stop string."""
    for k in range(1, len(turn) + 1):
        if any(s in text(turn[:k]) for s in stops):
            return k
    return None


def _spanning(tokens, j) -> str:
    """A stop string completed by token j: the last letter of token j-1's word + token j's."""
    return WORDS[tokens[j - 1]][-1] + WORDS[tokens[j]]


def _greedy_next(model, context) -> int:
    _, graphdef, params = model
    logits = decoder.jit_forward(
        graphdef, params, jnp.asarray([context]), jnp.arange(len(context))[None]
    )
    return int(jnp.argmax(logits[0, -1]))


def _all_pages_free(sampler) -> bool:
    return all(a.num_free == a.num_pages - 1 for a in sampler.scheduler.allocators)


def test_stop_string_cut_finds_the_first_token_that_completes_one():
    rng = np.random.default_rng(1)
    small = [w[:1] for w in WORDS[:8]]  # few letters: matches are frequent
    detok = lambda ids: "".join(small[i] for i in ids)
    for _ in range(200):
        turn = list(rng.integers(0, 8, 12))
        stops = ("".join(rng.choice(small, 3)),)
        first = next((k for k in range(1, 13) if any(s in detok(turn[:k]) for s in stops)), None)
        checked = int(rng.integers(0, (first or 13)))  # a prefix known to hold none
        assert stop_string_cut(detok, turn, checked, stops) == first


@pytest.mark.parametrize("kv_policy", ["keep", "recompute"])
@pytest.mark.parametrize("last", [7, 5], ids=["chunk_end", "mid_chunk"])
def test_a_stop_string_cuts_at_the_token_that_completes_it(model, kv_policy, last):
    sampler = _sampler(model, kv_policy)
    rng = np.random.default_rng(11)
    prompt = list(rng.integers(0, VOCAB, 7))
    sampler.submit(prompt, params=GREEDY)
    (uncut,) = _run(sampler)
    assert len(uncut.token_ids) == 16 and uncut.finish_reason == "length"
    tokens = uncut.token_ids
    stop = _spanning(tokens, last)  # chunks hold tokens 0-3, 4-7, ...: 7 ends one, 5 is inside
    assert _first_keep(tokens, [stop]) == last + 1, "pick another seed: the string is earlier"
    assert tokens[last + 1] not in tokens[: last + 1]
    runs = {
        "stop string": SamplingParams(temperature=0.0, max_new_tokens=16, stop_strings=(stop,)),
        # The device stops the sequence on the next token (mid_chunk: in the same chunk): the
        # stop string, completed before it, still decides where the output ends.
        "and a later stop token": SamplingParams(
            temperature=0.0,
            max_new_tokens=16,
            stop_strings=(stop,),
            stop_token_ids=(tokens[last + 1],),
        ),
    }
    for why, params in runs.items():
        sampler.submit(prompt, params=params)
        (cut,) = _run(sampler)
        assert cut.finish_reason == "stop", why
        assert cut.token_ids == tokens[: last + 1], why
        np.testing.assert_allclose(cut.logprobs, uncut.logprobs[: last + 1], rtol=1e-6, atol=1e-6)
        assert cut.versions == uncut.versions[: last + 1], why
        sampler.scheduler.check()
    assert _all_pages_free(sampler)


@pytest.mark.parametrize("kv_policy", ["keep", "recompute"])
def test_an_episode_cut_by_a_stop_string_resumes_past_the_dropped_kv(model, kv_policy):
    _, _, params = model
    sampler = _sampler(model, kv_policy)
    rng = np.random.default_rng(4)
    # 11 + 16 tokens: the chunk of tokens 4-7 reserved a third page (K/V up to position 17),
    # which the cut at token 5 (K/V kept up to position 15) no longer needs.
    prompt = list(rng.integers(0, VOCAB, 11))
    sampler.submit(prompt, params=GREEDY)
    (uncut,) = _run(sampler)
    last = 5  # mid-chunk: the device decoded tokens 6 and 7 and wrote K/V past the cut
    stop = _spanning(uncut.token_ids, last)
    assert _first_keep(uncut.token_ids, [stop]) == last + 1
    turn_params = dataclasses.replace(GREEDY, stop_strings=(stop,))
    sampler.submit(prompt, params=turn_params, episode=True)
    (turn,) = _run(sampler)
    assert turn.finish_reason == "stop" and turn.token_ids == uncut.token_ids[: last + 1]
    assert sampler.num_parked == 1
    (parked,) = sampler.scheduler.parked.values()
    assert parked.cached == len(prompt) + last  # K/V of every kept token but the last
    assert len(parked.pages) == pages_for(parked.cached, CONFIG.page_size) == 2
    sampler.scheduler.check()

    obs = list(rng.integers(0, VOCAB, 3))
    if kv_policy == "recompute":  # a swap (same weights) drops the parked cache
        sampler.set_params(params, version=1)
    sampler.resume(turn.request_id, turn.attempt, obs, max_new_tokens=5)
    (resumed,) = _run(sampler)
    n_turn = len(turn.token_ids)
    assert resumed.token_ids[: n_turn + len(obs)] == turn.token_ids + obs
    new = slice(n_turn + len(obs), None)
    assert resumed.token_ids[new], "the next turn decoded nothing"
    _check_greedy(
        model, prompt + turn.token_ids + obs, resumed.token_ids[new], resumed.logprobs[new]
    )
    sampler.scheduler.check()
    sampler.release(resumed.request_id, resumed.attempt)
    sampler.scheduler.check()
    assert sampler.num_parked == 0 and _all_pages_free(sampler)


def test_a_stop_string_in_the_observation_does_not_end_the_next_turn(model):
    sampler = _sampler(model)
    rng = np.random.default_rng(6)
    prompt = list(rng.integers(0, VOCAB, 6))
    first_turn = dataclasses.replace(GREEDY, max_new_tokens=6)
    sampler.submit(prompt, params=first_turn)
    (plain,) = _run(sampler)
    obs = list(rng.integers(0, VOCAB, 3))
    g0 = _greedy_next(model, prompt + plain.token_ids + obs)  # the next turn's first token
    in_obs = text(obs[1:])
    across = WORDS[obs[-1]][-1] + WORDS[g0][0]  # observation's end + the next turn's start
    stops = (in_obs, across)
    assert _first_keep(plain.token_ids, stops) is None

    sampler.submit(prompt, params=dataclasses.replace(first_turn, stop_strings=stops), episode=True)
    (turn,) = _run(sampler)
    assert turn.token_ids == plain.token_ids and turn.finish_reason == "length"
    sampler.resume(turn.request_id, turn.attempt, obs, max_new_tokens=6)
    (resumed,) = _run(sampler)
    new = resumed.token_ids[len(turn.token_ids) + len(obs) :]
    assert new[0] == g0
    assert _first_keep(new, stops) is None, "pick another seed: the new turn holds a stop"
    assert resumed.finish_reason == "length" and len(new) == 6
    sampler.release(resumed.request_id, resumed.attempt)
    sampler.scheduler.check()
    assert _all_pages_free(sampler)


def test_bad_stop_strings_come_back_as_error_samples(model):
    blind = _sampler(model, detokenize=None)
    blind.submit([5, 6, 7], n=2, params=SamplingParams(stop_strings=("</calc>",)))
    errors = blind.step()
    assert len(errors) == 2 and all(s.finish_reason == "error" for s in errors)
    assert "detokenize" in errors[0].error
    sampler = _sampler(model)
    for stops in [("</calc>", ""), "</calc>"]:
        sampler.submit([5, 6, 7], params=SamplingParams(stop_strings=stops))
        (err,) = sampler.step()
        assert err.finish_reason == "error" and "non-empty strings" in err.error
    assert not sampler.has_work() and _all_pages_free(sampler)


def test_stop_strings_travel_to_remote_samplers_as_json():
    params = SamplingParams(stop_token_ids=(3, 4), stop_strings=("</calc>", "\n\n"))
    sent = json.loads(json.dumps(dataclasses.asdict(params)))
    assert params_from_json(sent) == params
