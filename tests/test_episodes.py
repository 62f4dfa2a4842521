"""Episodes between a sampler and an environment (pipeline/episodes.py), with a scripted
sampler: the token layout of a finished episode (turns and observations in order, the
observation tokens at version -1, versions per turn, positions continuous in the train batch),
what the environment reads, the token budget, and environments that fail.

The scripted sampler decodes a whole turn per step() and bumps its version after every
step, as if a new policy were swapped in between any two turns.
"""

import dataclasses

import numpy as np
import pytest

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.data.tasks import CharTokenizer
from pipelinerl_jax.envs.codec import EpisodeCodec
from pipelinerl_jax.envs.protocol import Environment, Turn
from pipelinerl_jax.envs.runner import EnvironmentPool
from pipelinerl_jax.pipeline.episodes import (
    EpisodeDriver,
    episode_metrics,
    make_driver,
    run_episodes,
)
from pipelinerl_jax.pipeline.groups import completion_text
from pipelinerl_jax.rl.batch import ScoredSample, build_batch
from pipelinerl_jax.rl.config import BatchConfig
from pipelinerl_jax.sampler.protocol import Sample
from pipelinerl_jax.sampler.sequence import SamplingParams

TOK = CharTokenizer("0123456789+=:<>")
EOS = TOK.eos_token_id


class ScriptedSampler:
    """Episodes as the PagedSampler runs them, with turns drawn from an rng: each step()
    finishes every running turn at the current version, then the version goes up."""

    def __init__(self, seed: int, turn_len=(1, 4)):
        self.rng = np.random.default_rng(seed)
        self.turn_len = turn_len
        self.version = 0
        self.seqs: dict[tuple[int, int], Sample] = {}
        self.running: list[tuple[int, int]] = []
        self.parked: set[tuple[int, int]] = set()
        self.params: list[SamplingParams] = []
        self.budget: dict[tuple[int, int], int] = {}

    def submit(self, prompt_ids, *, n, params, request_id, episode=False):
        assert episode
        self.params.append(params)
        for a in range(n):
            key = (request_id, a)
            self.seqs[key] = Sample(request_id, a, list(prompt_ids), [], [], [], 0, "stop")
            self.budget[key] = params.max_new_tokens
            self.running.append(key)
        return request_id

    def has_work(self):
        return bool(self.running)

    def step(self):
        out = []
        for key in self.running:
            s = self.seqs[key]
            digits = self.rng.integers(3, 13, int(self.rng.integers(*self.turn_len)))  # "0".."9"
            turn = ([int(t) for t in digits] + [EOS])[: self.budget[key]]
            s.token_ids += turn
            s.logprobs += [float(x) for x in -self.rng.random(len(turn)) - 0.1]
            s.versions += [self.version] * len(turn)
            s.finish_reason = "stop" if turn[-1] == EOS else "length"
            self.parked.add(key)
            out.append(dataclasses.replace(s, token_ids=list(s.token_ids)))
        self.running = []
        self.version += 1
        return out

    def resume(self, request_id, attempt, observation_ids, *, max_new_tokens):
        key = (request_id, attempt)
        self.parked.remove(key)
        s = self.seqs[key]
        s.token_ids += list(observation_ids)
        s.logprobs += [0.0] * len(observation_ids)
        s.versions += [-1] * len(observation_ids)
        self.budget[key] = max_new_tokens
        self.running.append(key)

    def release(self, request_id, attempt):
        self.parked.remove((request_id, attempt))


class Echo(Environment):
    """Answers each turn with "<" or ">" (by the turn's parity) until `turns_needed` turns,
    then pays 1; records every call."""

    name = "echo"
    stop_strings = ("::",)

    def __init__(self, turns_needed=3, max_turns=5):
        super().__init__(max_turns=max_turns)
        self.turns_needed = turns_needed
        self.calls: list[list[str]] = []

    def first_messages(self, problem):
        return [{"role": "user", "content": problem.question}]

    def respond(self, problem, turns):
        self.calls.append(list(turns))
        if len(turns) >= self.turns_needed:
            return Turn(None, reward=1.0, done=True, info={"status": "correct", "tool_calls": 2})
        return Turn({"role": "user", "content": "<>"[len(turns) % 2] * 2}, info={"tool_calls": 1})


PROBLEMS = [Problem(uid=f"p{i}", question=f"{i}:9=", answer="5", source="t") for i in range(3)]


def _driver(env, pool, max_new_tokens=40):
    turn_text = lambda ids: completion_text(TOK, ids, (EOS,))
    return EpisodeDriver(env, pool, EpisodeCodec(TOK), turn_text, max_new_tokens=max_new_tokens)


def _scored(episode, *, reward: float, group_id: int) -> ScoredSample:
    s = episode.sample
    return ScoredSample(s.prompt_ids, s.token_ids, s.logprobs, s.versions, reward, group_id)


def test_an_episode_is_its_turns_and_observations_in_order():
    env = Echo(turns_needed=3)
    sampler = ScriptedSampler(seed=1)
    with EnvironmentPool(num_workers=0) as pool:
        driver = _driver(env, pool)
        params = SamplingParams(max_new_tokens=40, stop_strings=("##",))
        episodes = run_episodes(sampler, driver, PROBLEMS, n=2, params=params)
    assert sampler.params[0].stop_strings == ("##", "::")  # the environment's join the run's
    assert [(e.sample.request_id, e.sample.attempt) for e in episodes] == [
        (i, a) for i in range(3) for a in range(2)
    ]
    assert not sampler.parked  # every episode released its pages
    for e in episodes:
        s = e.sample
        assert s.prompt_ids == TOK.encode(PROBLEMS[s.request_id].question)
        assert e.turns == 3 and e.reward == 1.0 and e.ending == "ok" and e.status == "correct"
        assert e.counts == {"tool_calls": 4}
        versions = np.asarray(s.versions)
        obs = versions < 0
        # Three turns, two observations of 2 tokens: "<<" after turn 1, ">>" after turn 2.
        runs = np.flatnonzero(np.diff(obs.astype(int))) + 1
        parts = np.split(np.asarray(s.token_ids), runs)
        assert len(parts) == 5
        assert TOK.decode(parts[1]) == ">>" and TOK.decode(parts[3]) == "<<"
        # Each turn is decoded at one version, later turns at later versions.
        turn_versions = [set(v) for v in np.split(versions, runs)[::2]]
        assert all(len(v) == 1 for v in turn_versions)
        assert [v.pop() for v in turn_versions] == sorted({int(v) for v in versions[~obs]})
        assert e.version_span == versions.max() - versions[~obs].min() > 0
        assert np.all(np.asarray(s.logprobs)[obs] == 0.0)
        # The environment read each turn's text, less its EOS, never the observations.
        turns = [completion_text(TOK, p, (EOS,)) for p in parts[::2]]
        assert turns in env.calls
        assert e.model_tokens + e.observation_tokens == len(s.token_ids)
    m = episode_metrics(episodes)
    assert m["episode/turns_mean"] == 3 and m["episode/tool_calls_mean"] == 4
    assert m["episode/observation_tokens_mean"] == 4 and m["episode/error_frac"] == 0


def test_the_train_batch_masks_observations_and_keeps_positions_continuous():
    env = Echo(turns_needed=4)
    with EnvironmentPool(num_workers=0) as pool:
        episodes = run_episodes(
            ScriptedSampler(seed=2),
            _driver(env, pool),
            PROBLEMS[:1],
            n=2,
            params=SamplingParams(max_new_tokens=40),
        )
    samples = [_scored(e, reward=float(i), group_id=0) for i, e in enumerate(episodes)]
    cfg = BatchConfig(seq_len=64, num_rows=2, max_sequences=2, max_sequence_len=50)
    batch, stats = build_batch(samples, cfg)
    for i, s in enumerate(samples):
        row = batch.segment_ids[0] == i + 1
        p, c = len(s.prompt_tokens), len(s.completion_tokens)
        np.testing.assert_array_equal(batch.positions[0][row], np.arange(p + c))
        np.testing.assert_array_equal(
            batch.tokens[0][row], list(s.prompt_tokens) + list(s.completion_tokens)
        )
        model = np.asarray(s.completion_versions) >= 0
        np.testing.assert_array_equal(batch.loss_mask[0][row][p - 1 : p + c - 1], model)
        np.testing.assert_array_equal(
            batch.versions[0][row][p - 1 : p + c - 1][model],
            np.asarray(s.completion_versions)[model],
        )
    assert stats["observation_tokens"] == sum(e.observation_tokens for e in episodes)
    assert stats["completion_tokens"] == sum(e.model_tokens for e in episodes)


def test_an_observation_past_the_token_budget_ends_the_episode():
    env = Echo(turns_needed=10, max_turns=10)
    with EnvironmentPool(num_workers=0) as pool:
        episodes = run_episodes(
            ScriptedSampler(seed=3, turn_len=(3, 4)),
            _driver(env, pool, max_new_tokens=12),
            PROBLEMS[:2],
            n=1,
            params=SamplingParams(max_new_tokens=12),
        )
    for e in episodes:
        assert e.ending == "length" and e.status == "no_answer" and e.reward == 0.0
        assert len(e.sample.token_ids) <= 12


class Broken(Environment):
    """Fails as its problem says: raises, answers garbage, or hangs."""

    name = "broken"

    def first_messages(self, problem):
        return [{"role": "user", "content": problem.question}]

    def respond(self, problem, turns):
        how = problem.answer
        if how == "raise":
            raise RuntimeError("the tool crashed")
        if how == "garbage":
            return {"not": "a turn"}
        if how == "hang":
            import time  # noqa: PLC0415 - only the worker that hangs needs it

            time.sleep(60)
        return Turn({"role": "user", "content": "0"})


@pytest.mark.parametrize("workers", [0, 1])
def test_failing_environments_end_their_episode_with_a_status(workers):
    cases = ["raise", "garbage"] + (["hang"] if workers else [])
    problems = [Problem(uid=h, question="1:2=", answer=h, source="t") for h in cases]
    # A fresh worker's first turn imports the environment's module: on a loaded 2-core
    # machine that took over 2 s, so the timeout leaves room for it.
    with EnvironmentPool(num_workers=workers, timeout_s=6.0) as pool:
        episodes = run_episodes(
            ScriptedSampler(seed=4),
            _driver(Broken(max_turns=3), pool),
            problems,
            n=1,
            params=SamplingParams(max_new_tokens=30),
        )
    got = {problems[e.sample.request_id].answer: e for e in episodes}
    assert got["raise"].ending == "error" and "the tool crashed" in got["raise"].detail
    assert got["garbage"].ending == "error" and "not a Turn" in got["garbage"].detail
    if workers:
        assert got["hang"].ending == "timeout"
    for e in episodes:
        assert e.reward == 0.0 and e.verdict().status in ("error", "timeout")
        assert e.turns == 1


def test_make_driver_templates_the_first_messages():
    from pipelinerl_jax.pipeline.env_spec import EnvSpec

    spec = EnvSpec(name="guess", options=(("higher", ">"), ("lower", "<")), workers=0)
    driver = make_driver(spec, TOK, pool=None, max_new_tokens=8)
    problem = Problem(uid="g", question="0:15=", answer="7", source="guess_number")
    assert driver.prompt_ids(problem) == TOK.encode("0:15=")


def test_trainer_logprobs_equal_the_samplers_over_a_real_episode():
    """Episodes from the PagedSampler (tiny model, one version), packed with the shared
    prompt as the trainer packs them: the trainer's forward over the packed rows gives every
    model token the sampler's behaviour logprob, to 1e-5."""
    import jax

    from pipelinerl_jax import models
    from pipelinerl_jax.envs.guess import GuessNumber
    from pipelinerl_jax.models import attention, decoder
    from pipelinerl_jax.rl.logprobs import full_logprobs
    from pipelinerl_jax.sampler.config import SamplerConfig
    from pipelinerl_jax.sampler.sampler import PagedSampler

    _, graphdef, params = models.tiny("llama", seed=4, vocab_size=TOK.vocab_size)
    config = SamplerConfig(num_slots=8, max_seq_len=48, page_size=8, chunk_steps=3)
    sampler = PagedSampler(graphdef, params, config, eos_token_ids=(EOS,), detokenize=TOK.decode)
    env = GuessNumber(higher=">", lower="<", again="=", base=16, max_turns=4)
    with EnvironmentPool(num_workers=0) as pool:
        driver = EpisodeDriver(
            env,
            pool,
            EpisodeCodec(TOK),
            lambda ids: completion_text(TOK, ids, (EOS,)),
            max_new_tokens=30,
            turn_tokens=2,
        )
        problems = [
            Problem(uid=f"g{i}", question="0:15=", answer=str(i), source="g") for i in (3, 11)
        ]
        episodes = run_episodes(
            sampler,
            driver,
            problems,
            n=4,
            params=SamplingParams(temperature=1.0, max_new_tokens=30),
        )
    assert max(e.turns for e in episodes) >= 3
    assert sum(e.observation_tokens > 0 for e in episodes) >= len(episodes) // 2
    samples = [_scored(e, reward=e.reward, group_id=e.sample.request_id) for e in episodes]
    cfg = BatchConfig(
        seq_len=96, num_rows=8, max_sequences=8, max_sequence_len=40, share_prompts=True
    )
    batch, _ = build_batch(samples, cfg)
    attend = attention.segment_causal_attention(batch.segment_ids, batch.prefix_ids)
    hidden, _ = decoder.forward_hidden(
        graphdef, params, batch.tokens, batch.positions, attend=attend
    )
    lp, _ = full_logprobs(hidden, decoder.lm_head_weight(params), batch.targets)
    mask = np.asarray(batch.loss_mask) > 0
    assert mask.sum() == sum(e.model_tokens for e in episodes)
    np.testing.assert_allclose(
        np.asarray(jax.device_get(lp))[mask], np.asarray(batch.behaviour_logprobs)[mask], atol=1e-5
    )
