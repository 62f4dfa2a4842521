"""Episodes: attempts of several model turns, each answered by an environment.

One attempt's life, with the sampler thread doing every sampler call:
  1. `submit` queues the attempts of a prompt as episodes (`Sampler.submit(episode=True)`),
     with the environment's stop strings;
  2. a turn finishes (`on_sample`): its text goes to the environment pool with the turns
     before it, off the sampler thread, while the attempt stays parked in the sampler with
     its KV pages;
  3. the answer comes back (`advance`, at the next chunk boundary): the observation's tokens
     are appended and decoding resumes on the kept pages (`Sampler.resume`), or the episode
     is over (`Sampler.release`) and comes back as a finished `Episode`.
Weights may be swapped between any two chunks, so one episode's turns, even one turn, may
carry several versions; observation tokens carry version -1 and are never trained on
(rl/batch.py). The lag bound needs nothing more: every token of a group is decoded at or
after the version it started at, and the step that trains the group waits for its last turn
(pipeline/admission.py).

`max_new_tokens` bounds the whole episode after the prompt (model turns and observations),
so the train batch's shapes are those of one-turn runs; an observation that would leave no
room ends the episode ("length"). `turn_tokens` (optional) bounds each model turn too: a turn
cut there still goes to the environment, which answers what it can read. An environment that fails (error, timeout, a malformed
answer) ends its episode with reward 0 and a status the metrics count.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.envs.codec import EpisodeCodec
from pipelinerl_jax.envs.protocol import Environment, Turn
from pipelinerl_jax.pipeline.groups import completion_text
from pipelinerl_jax.rewards.tables import STATUSES, Verdict
from pipelinerl_jax.sampler.protocol import Sample
from pipelinerl_jax.sampler.sequence import SamplingParams

ENDINGS = ("ok", "error", "timeout", "length")  # how an episode ended (Episode.ending)


@dataclasses.dataclass(frozen=True)
class Episode:
    """A finished attempt of several turns."""

    sample: Sample  # the whole episode: token_ids holds every turn and observation
    reward: float  # the sum of the environment's turn rewards (0 when it failed)
    ending: str  # one of ENDINGS: the environment ended it (ok), failed, or it ran out of room
    status: str  # a rewards.tables status: what the last turn's answer was (or error/timeout)
    turns: int  # model turns
    counts: dict  # the environment's numeric turn infos, summed (tool_calls, tool_errors, ...)
    detail: str = ""  # why the environment failed
    seconds: float = 0.0  # wall time from submission to the end

    @property
    def model_tokens(self) -> int:
        return sum(v >= 0 for v in self.sample.versions)

    @property
    def observation_tokens(self) -> int:
        return len(self.sample.versions) - self.model_tokens

    @property
    def version_span(self) -> int:
        """Policy versions between the first and the last model token (0: one version)."""
        versions = [v for v in self.sample.versions if v >= 0]
        return max(versions) - min(versions) if versions else 0

    def verdict(self) -> Verdict:
        """The episode as the reward table scores it: its reward is the verdict's score."""
        score = self.reward if self.status in ("correct", "wrong") else 0.0
        return Verdict(status=self.status, score=score, detail=self.detail)


@dataclasses.dataclass
class _Attempt:
    problem: Problem
    messages: list[dict]
    started: float
    sample: Sample | None = None  # the episode so far, as the last turn returned it
    turn_start: int = 0  # where the current turn begins in sample.token_ids
    turns: list[str] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    status: str | None = None  # the last turn's info["status"]


class EpisodeDriver:
    """Runs the episodes of one environment between a sampler and an environment pool."""

    def __init__(
        self,
        env: Environment,
        pool,
        codec: EpisodeCodec,
        turn_text: Callable[[Sequence[int]], str],
        *,
        max_new_tokens: int,
        turn_tokens: int = 0,
    ):
        """pool: an envs.runner.EnvironmentPool (anything with submit(env, problem, turns)
        returning a Future of a Turn); turn_text: a model turn's tokens -> the text the
        environment reads (pipeline.groups.completion_text)."""
        self.env, self.pool, self.codec, self.turn_text = env, pool, codec, turn_text
        self.max_new_tokens, self.turn_tokens = max_new_tokens, turn_tokens
        self._attempts: dict[tuple[int, int], _Attempt] = {}
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._answered = threading.Event()
        self._with_env = 0  # turns the environment is answering

    # --- the sampler thread -------------------------------------------------------------

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The first turn's prompt: the environment's first messages, templated."""
        return self.codec.prompt(self.env.first_messages(problem))

    def submit(
        self,
        sampler,
        problem: Problem,
        prompt_ids: Sequence[int],
        *,
        n: int,
        params: SamplingParams,
        request_id: int,
    ) -> None:
        """Starts n episodes of `problem` (request `request_id`, attempts 0..n-1)."""
        messages = self.env.first_messages(problem)
        now = time.perf_counter()
        for attempt in range(n):
            self._attempts[(request_id, attempt)] = _Attempt(problem, messages, now)
        stops = tuple(dict.fromkeys(params.stop_strings + tuple(self.env.stop_strings)))
        budget = self._turn_budget(params.max_new_tokens)
        sampler.submit(
            prompt_ids,
            n=n,
            params=dataclasses.replace(params, stop_strings=stops, max_new_tokens=budget),
            request_id=request_id,
            episode=True,
        )

    def on_sample(self, sample: Sample) -> Episode | None:
        """A turn finished: it goes to the environment (None), or, when the sampler could not
        run it, the episode ends here."""
        key = (sample.request_id, sample.attempt)
        att = self._attempts[key]
        att.sample = sample
        if sample.finish_reason == "error":
            return self._finish(key, "error", "error", sample.error or "sampler error")
        att.turns.append(self.turn_text(sample.token_ids[att.turn_start :]))
        self._with_env += 1
        future = self.pool.submit(self.env, att.problem, list(att.turns))
        future.add_done_callback(lambda f: self._answer(key, f))
        return None

    def advance(self, sampler) -> list[Episode]:
        """Applies the environment's answers that arrived: resumes those episodes or ends
        them. Call at a chunk boundary, from the sampler thread."""
        self._answered.clear()
        finished = []
        while True:
            try:
                key, turn = self._answers.get_nowait()
            except queue.Empty:
                return finished
            self._with_env -= 1
            episode = self._apply(sampler, key, turn)
            if episode is not None:
                finished.append(episode)

    def wait(self, timeout_s: float) -> None:
        """Blocks until an answer arrives or `timeout_s` passed (nothing to decode meanwhile)."""
        if self._answers.empty():
            self._answered.wait(timeout_s)

    @property
    def with_env(self) -> int:
        """Turns the environment is answering now."""
        return self._with_env

    @property
    def num_open(self) -> int:
        """Episodes started and not finished."""
        return len(self._attempts)

    # --- inside ---------------------------------------------------------------------------

    def _answer(self, key, future) -> None:  # the pool's thread
        try:
            turn = future.result()
        except Exception as e:  # noqa: BLE001 - the pool resolves every turn; belt and braces
            turn = Turn(None, done=True, status="error", info={"detail": repr(e)[:300]})
        self._answers.put((key, turn))
        self._answered.set()

    def _apply(self, sampler, key, turn: Turn) -> Episode | None:
        att = self._attempts[key]
        att.reward += float(turn.reward)
        for name, value in turn.info.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                att.counts[name] += value
        if isinstance(turn.info.get("status"), str):
            att.status = turn.info["status"]
        if turn.status != "ok":
            sampler.release(*key)
            detail = str(turn.info.get("detail", turn.status))
            return self._finish(key, turn.status, turn.status, detail)
        if turn.done:
            sampler.release(*key)
            return self._finish(key, "ok", self._status(att))
        tokens = att.sample.token_ids
        obs_ids = self.codec.observation(att.messages, tokens[att.turn_start :], turn.observation)
        room = self.max_new_tokens - len(tokens) - len(obs_ids)
        if room < 1 or not obs_ids:
            sampler.release(*key)
            return self._finish(key, "length", self._status(att, default="no_answer"))
        att.turn_start = len(tokens) + len(obs_ids)
        sampler.resume(key[0], key[1], obs_ids, max_new_tokens=self._turn_budget(room))
        return None

    def _turn_budget(self, room: int) -> int:
        return min(room, self.turn_tokens) if self.turn_tokens else room

    def _status(self, att: _Attempt, default: str | None = None) -> str:
        if att.status in STATUSES:
            return att.status
        if default is not None:
            return default
        return "correct" if att.reward >= 1.0 else "wrong"

    def _finish(self, key, ending: str, status: str, detail: str = "") -> Episode:
        att = self._attempts.pop(key)
        failed = ending in ("error", "timeout")
        return Episode(
            sample=att.sample,
            reward=0.0 if failed else att.reward,
            ending=ending,
            status=status,
            turns=len(att.turns),
            counts=dict(att.counts),
            detail=detail,
            seconds=time.perf_counter() - att.started,
        )


def run_episodes(
    sampler, driver: EpisodeDriver, problems: Sequence[Problem], *, n: int, params
) -> list[Episode]:
    """Every problem's n episodes to the end on an idle sampler, in (problem, attempt) order
    (held-out evaluation; the pipeline interleaves the same calls with training)."""
    for i, problem in enumerate(problems):
        driver.submit(
            sampler, problem, driver.prompt_ids(problem), n=n, params=params, request_id=i
        )
    done: list[Episode] = []
    while driver.num_open:
        for sample in sampler.step() if sampler.has_work() else ():
            episode = driver.on_sample(sample)
            if episode is not None:
                done.append(episode)
        done.extend(driver.advance(sampler))
        if not sampler.has_work() and driver.num_open:
            driver.wait(0.05)
    return sorted(done, key=lambda e: (e.sample.request_id, e.sample.attempt))


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-step means over finished episodes: turns, tool use, environment failures, tokens,
    and how many policy versions an episode spans."""
    if not episodes:
        return {}
    n = len(episodes)
    counts = collections.Counter()
    for e in episodes:
        counts.update(e.counts)
    model = sum(e.model_tokens for e in episodes)
    obs = sum(e.observation_tokens for e in episodes)
    out = {
        "episode/turns_mean": sum(e.turns for e in episodes) / n,
        "episode/turns_max": max(e.turns for e in episodes),
        "episode/model_tokens_mean": model / n,
        "episode/observation_tokens_mean": obs / n,
        "episode/version_span_mean": sum(e.version_span for e in episodes) / n,
        "episode/version_span_max": max(e.version_span for e in episodes),
        "episode/seconds_mean": sum(e.seconds for e in episodes) / n,
    }
    for ending in ENDINGS[1:]:
        out[f"episode/{ending}_frac"] = sum(e.ending == ending for e in episodes) / n
    for name in sorted(counts):
        out[f"episode/{name}_mean"] = counts[name] / n
    return out


def make_driver(env_spec, tokenizer, pool, *, max_new_tokens: int) -> EpisodeDriver:
    """The driver of a run's env section (pipeline.config.EnvSpec), on `pool`. A model
    turn's text is its tokens with every special token visible, less a final stop token
    (what a reward function reads of a one-turn answer)."""
    stop_ids = tuple(getattr(tokenizer, "eos_token_ids", ()))
    return EpisodeDriver(
        env_spec.make(),
        pool,
        EpisodeCodec(tokenizer),
        lambda ids: completion_text(tokenizer, ids, stop_ids),
        max_new_tokens=max_new_tokens,
        turn_tokens=env_spec.turn_tokens,
    )
