"""Evaluation on a test set: k attempts per problem on the sampler, scored, summarised.

    results = evaluate_problems(sampler, tokenizer, problems, "math", k=4,
                                sampling_params=SamplingParams(temperature=1.0, max_new_tokens=512),
                                prompt_config=PromptConfig())
    results["avg@k"], results["pass@k"], results["status"]

The same function serves `python -m pipelinerl_jax.evaluate` and periodic evaluation inside
a run. Metrics, with c_i correct attempts out of k for problem i of n:
  avg@k   = Σ c_i / (n·k)        mean success of one attempt (= the unbiased pass@1)
  pass@k  = #{i : c_i > 0} / n   at least one of the k attempts is correct
  score_mean                     mean verdict score (partial credit of the procedural tasks)
plus answer statuses (correct / wrong / no_answer / unparsable / error / timeout), finish
reasons, completion lengths in tokens, and the same per data source.

A prompt that cannot be encoded or that the sampler rejects (longer than the context) gives
k attempts with status `error`; nothing is silently dropped.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.data.prompts import PromptConfig, build_prompt
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline.episodes import EpisodeDriver, episode_metrics, run_episodes
from pipelinerl_jax.rewards.tables import (
    BUILTIN_REWARDS,
    STATUSES,
    Verdict,
    as_verdict,
    resolve_callable,
)

FINISH_REASONS = ("stop", "length", "error")


def encode_problem(problem: Problem, tokenizer, prompt_config: PromptConfig) -> list[int]:
    """Prompt ids of one problem, as the pipeline builds them (components.py's build_data)."""
    text = build_prompt(problem.question, tokenizer, prompt_config)
    return list(tokenizer.encode(text, add_special_tokens=prompt_config.template == "plain"))


def _inline(fn: Callable, completion: str, problem: Problem) -> Verdict:
    try:
        return as_verdict(fn(completion, problem))
    except Exception as e:  # a reward must not end the evaluation
        return Verdict(status="error", detail=f"{type(e).__name__}: {e}"[:300])


def score(reward_fn, pairs: Sequence[tuple[str, Problem]]) -> list[Verdict]:
    """Verdicts of (completion, problem) pairs with a RewardPool (anything with `map`), a
    built-in name / "module:callable" string (run inline), or a callable (inline)."""
    if hasattr(reward_fn, "map"):
        return list(reward_fn.map(pairs))
    if isinstance(reward_fn, str):
        reward_fn = resolve_callable(BUILTIN_REWARDS.get(reward_fn, reward_fn))
    return [_inline(reward_fn, c, p) for c, p in pairs]


def _summary(rows: list[dict], k: int) -> dict:
    """Aggregate metrics of per-attempt rows (each: problem, status, score, ...)."""
    by_problem: dict[int, list[dict]] = collections.defaultdict(list)
    for r in rows:
        by_problem[r["problem"]].append(r)
    correct = np.array(
        [sum(r["status"] == "correct" for r in attempts) for attempts in by_problem.values()],
        np.float64,
    )
    generated = [r for r in rows if r["finish_reason"] != "error"]
    lengths = np.array([r["num_tokens"] for r in generated], np.float64)
    n = len(by_problem)
    return {
        "num_problems": n,
        "k": k,
        "num_samples": len(rows),
        "avg@k": float(correct.sum() / (n * k)) if n else float("nan"),
        "pass@k": float(np.mean(correct > 0)) if n else float("nan"),
        "score_mean": float(np.mean([r["score"] for r in rows])) if rows else float("nan"),
        "status": {s: sum(r["status"] == s for r in rows) for s in STATUSES},
        "finish": {f: sum(r["finish_reason"] == f for r in rows) for f in FINISH_REASONS},
        "len_mean": float(lengths.mean()) if len(lengths) else 0.0,
        "len_max": int(lengths.max()) if len(lengths) else 0,
        "no_eos_frac": (
            float(np.mean([r["finish_reason"] == "length" for r in generated]))
            if generated
            else 0.0
        ),
    }


def evaluate_problems(
    sampler,
    tokenizer,
    problems: Sequence[Problem],
    reward_fn,
    k: int,
    sampling_params,
    prompt_config: PromptConfig,
    *,
    return_samples: bool = False,
    progress=None,
) -> dict:
    """Generates k attempts per problem, scores them, and summarises (see the module doc).

    sampler: an idle `sampler.protocol.Sampler`, e.g. a `PagedSampler` (its other requests'
      samples would be consumed here, so it must have no work queued; raises RuntimeError
      otherwise).
    tokenizer: encode / decode (and apply_chat_template for the chat template).
    reward_fn: a RewardPool, a reward name or "module:callable", or a callable
      (completion, problem) -> Verdict | float.
    progress: optional callable(num_finished_samples) for progress bars.
    Returns the metrics dict; with return_samples, "samples" lists every attempt.
    """
    if k < 1:
        raise ValueError(f"k={k} attempts per problem must be >= 1")
    if sampler.has_work():
        raise RuntimeError(
            "evaluate_problems needs an idle sampler (it would consume the "
            "samples of the requests already queued); evaluate between chunks "
            "once the sampler has drained, or on a separate Sampler"
        )
    rows: list[dict] = []
    request_of: dict[int, int] = {}
    for i, problem in enumerate(problems):
        try:
            ids = encode_problem(problem, tokenizer, prompt_config)
        except ConfigError:  # the template itself is wrong (e.g. no chat template): stop
            raise
        except Exception as e:  # e.g. a character outside a task tokenizer's vocabulary
            error = f"cannot encode the prompt: {type(e).__name__}: {e}"[:300]
            rows.extend(
                _row(i, problem, a, None, Verdict(status="error", detail=error), error)
                for a in range(k)
            )
            continue
        request_of[sampler.submit(ids, n=k, params=sampling_params)] = i
    samples = []
    while sampler.has_work():
        done = [s for s in sampler.step() if s.request_id in request_of]
        samples.extend(done)
        if progress is not None and done:
            progress(len(done))
    samples.sort(key=lambda s: (request_of[s.request_id], s.attempt))
    generated = [s for s in samples if s.finish_reason != "error"]
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in generated]
    verdicts = iter(
        score(
            reward_fn, [(t, problems[request_of[s.request_id]]) for t, s in zip(texts, generated)]
        )
    )
    texts_it = iter(texts)
    for s in samples:
        i = request_of[s.request_id]
        if s.finish_reason == "error":
            rows.append(
                _row(
                    i,
                    problems[i],
                    s.attempt,
                    s,
                    Verdict(status="error", detail=s.error or ""),
                    s.error,
                )
            )
        else:
            rows.append(
                _row(i, problems[i], s.attempt, s, next(verdicts), None, completion=next(texts_it))
            )
    rows.sort(key=lambda r: (r["problem"], r["attempt"]))
    results = _summary(rows, k)
    sources = sorted({r["source"] for r in rows})
    results["per_source"] = {
        src: {
            key: value
            for key, value in _summary([r for r in rows if r["source"] == src], k).items()
            if key in ("num_problems", "avg@k", "pass@k", "score_mean", "len_mean")
        }
        for src in sources
    }
    if return_samples:
        results["samples"] = rows
    return results


def evaluate_episodes(
    sampler,
    driver: EpisodeDriver,
    problems: Sequence[Problem],
    k: int,
    sampling_params,
    *,
    return_samples: bool = False,
) -> dict:
    """evaluate_problems for multi-turn episodes: k episodes per problem with `driver`'s
    environment, each scored by its reward; plus the episode metrics (episodes.py)."""
    if k < 1:
        raise ValueError(f"k={k} attempts per problem must be >= 1")
    if sampler.has_work():
        raise RuntimeError("evaluate_episodes needs an idle sampler (see evaluate_problems)")
    episodes = run_episodes(sampler, driver, problems, n=k, params=sampling_params)
    rows = []
    for e in episodes:
        i = e.sample.request_id
        failed = e.ending in ("error", "timeout")
        text = driver.turn_text(e.sample.token_ids)
        rows.append(
            _row(i, problems[i], e.sample.attempt, e.sample, e.verdict(), None, completion=text)
        )
        rows[-1]["score"] = 0.0 if failed else e.reward
        rows[-1]["turns"] = e.turns
    results = _summary(rows, k)
    results.update(episode_metrics(episodes))
    if return_samples:
        results["samples"] = rows
    return results


def _row(
    index: int,
    problem: Problem,
    attempt: int,
    sample,
    verdict: Verdict,
    error: str | None,
    completion: str = "",
) -> dict[str, Any]:
    return {
        "problem": index,
        "uid": problem.uid,
        "source": problem.source,
        "attempt": attempt,
        "completion": completion,
        "answer": problem.answer,
        "status": verdict.status,
        "score": float(verdict.score) if verdict.status in ("correct", "wrong") else 0.0,
        "predicted": verdict.predicted,
        "finish_reason": "error" if sample is None else sample.finish_reason,
        "num_tokens": 0 if sample is None else len(sample.token_ids),
        "error": error or (verdict.detail if verdict.status in ("error", "timeout") else None),
    }
