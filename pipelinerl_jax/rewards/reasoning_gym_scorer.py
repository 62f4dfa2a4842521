"""reasoning-gym's datasets and scorers: a completion's answer, scored by its dataset's own rule.

reasoning-gym (github.com/open-thought/reasoning-gym) generates about a hundred kinds of
problem; a dataset scores an answer with `score_answer(answer, entry)` in [0, 1], which reads
the whole entry (question, answer, metadata) and, for a few datasets (decimal_arithmetic,
time_intervals, puzzle24, arc_agi ...), the dataset's config. A problem of the reasoning_gym
task (data/reasoning_gym_task.py) therefore carries, in `Problem.meta`, the dataset's name and
config and the entry itself, so that any process can score it: a reward worker rebuilds the
dataset from its name and config (cached) and scores the very entry the model was shown.

Why carry the entry instead of regenerating it from its index: a few datasets (word_ladder,
isomorphic_strings, knight_swap, ransom_note, polynomial_multiplication) draw differently in
another interpreter (they iterate over sets of strings, whose order follows PYTHONHASHSEED),
and a reward worker is another interpreter; some entries also take a second to generate. Why a
tagged JSON (`encode` / `decode`): plain JSON turns tuples into lists and int keys into text,
and arc_agi and rearc compare the parsed answer with a tuple of tuples in the metadata, so every
right answer would score 0.05. Tuples, sets and dicts with keys other than text are tagged, so
the entry decodes exactly as it was generated, and the text survives checkpoints as it is.

The answer is read the way reasoning-gym's prompts ask for it: the text of the last
`<answer>...</answer>` (its own `extract_answer`; `SYSTEM_PROMPT` is its default system prompt,
which asks for those tags). Without answer tags the last `\\boxed{}` is read instead, since the
run's default system prompt (the paper's) asks for that. Neither: `no_answer`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from typing import Any

import reasoning_gym
from reasoning_gym.composite import DatasetSpec
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.boxed import last_boxed
from pipelinerl_jax.rewards.tables import Verdict

SYSTEM_PROMPT = SYSTEM_PROMPTS["default"]  # reasoning-gym's: think, then <answer>...</answer>
_TAGS = ("__tuple__", "__set__", "__frozenset__", "__items__")
_CACHED_DATASETS = 16  # datasets kept per process (a run uses two: train and held out)


def dataset_names() -> list[str]:
    """Every registered reasoning-gym dataset, sorted."""
    return sorted(DATASETS)


# --- the entry as JSON text, exactly ---------------------------------------------------------


def encode(value: Any) -> Any:
    """value as JSON-able data that `decode` turns back into an equal value of the same types."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if type(value).__module__ == "numpy" and hasattr(value, "item"):  # a numpy scalar
        return encode(value.item())
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        tag = "__set__" if isinstance(value, set) else "__frozenset__"
        return {tag: sorted((encode(v) for v in value), key=repr)}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not set(_TAGS) & set(value):
            return {k: encode(v) for k, v in value.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in value.items()]}
    raise TypeError(f"a {type(value).__name__} cannot be carried as JSON")


def decode(data: Any) -> Any:
    """The value `encode` was given."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, items), *_ = data.items()
        if tag == "__tuple__":
            return tuple(decode(v) for v in items)
        if tag == "__set__":
            return {decode(v) for v in items}
        if tag == "__frozenset__":
            return frozenset(decode(v) for v in items)
        if tag == "__items__":
            return {decode(k): decode(v) for k, v in items}
    return {k: decode(v) for k, v in data.items()}


def canonical_config(config: dict) -> str:
    """The config as JSON text with sorted keys: equal configs give equal text (a cache key)."""
    return json.dumps(encode(config), sort_keys=True)


def dump_meta(name: str, config: dict, index: int, entry: dict) -> str:
    """What `Problem.meta` carries for reward functions: the dataset, its config, the entry."""
    return json.dumps(
        {"dataset": name, "config": encode(config), "index": index, "entry": encode(entry)}
    )


def load_meta(meta: str) -> tuple[str, dict, dict]:
    """(dataset name, config, entry) from `dump_meta`'s text."""
    data = json.loads(meta)
    return data["dataset"], decode(data["config"]), decode(data["entry"])


# --- datasets --------------------------------------------------------------------------------


def make_dataset(name: str, config: dict):
    """reasoning_gym.create_dataset(name, **config), or a one-line ConfigError saying what is
    wrong (the dataset's name, an option it lacks, a value its own checks reject) and how to fix
    it. composite's `datasets` may be dicts (name, weight, config), as in its YAML files."""
    where = "task reasoning_gym"
    if name not in DATASETS:
        close = difflib.get_close_matches(str(name), DATASETS, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ConfigError(
            f"{where}: unknown dataset name={name!r}; {hint}choose one of the "
            f"{len(DATASETS)} reasoning-gym datasets, e.g. chain_sum, basic_arithmetic, "
            "gsm_symbolic, leg_counting, spell_backward (reasoning_gym.factory.DATASETS)"
        )
    _, config_cls = DATASETS[name]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(config) - fields)
    if unknown:
        own = sorted(fields - {"seed", "size"})  # those two are the task's options
        close = difflib.get_close_matches(unknown[0], own, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{where}: dataset {name} has no option {unknown[0]!r}{hint}; valid: {own}"
        )
    kwargs = dict(config)
    if name == "composite" and isinstance(kwargs.get("datasets"), (list, tuple)):
        kwargs["datasets"] = [
            DatasetSpec(**d) if isinstance(d, dict) else d for d in kwargs["datasets"]
        ]
    try:
        return reasoning_gym.create_dataset(name, **kwargs)
    except Exception as e:  # the user's options: any failure here is theirs to fix, in one line
        reason = " ".join(str(e).split()) or "its config check failed"
        shown = json.dumps(encode(config), sort_keys=True)
        shown = shown if len(shown) <= 200 else shown[:197] + "..."
        raise ConfigError(
            f"{where}: dataset {name} rejects the options {shown}: {type(e).__name__}: {reason}"
        ) from None


@functools.lru_cache(maxsize=_CACHED_DATASETS)
def _cached(name: str, config_text: str):
    return make_dataset(name, decode(json.loads(config_text)))


def dataset(name: str, config: dict):
    """The dataset `make_dataset` builds, built once per process for each name and config."""
    return _cached(name, canonical_config(config))


# --- the reward ------------------------------------------------------------------------------


def read_answer(completion: str) -> str | None:
    """The answer a completion gives: its last <answer>...</answer>, else its last \\boxed{}."""
    answer = extract_answer(completion)
    if answer is None:
        answer = last_boxed(completion)
    answer = answer.strip() if answer is not None else None
    return answer or None


def reasoning_gym_reward(completion: str, problem) -> Verdict:
    """The `reasoning_gym` built-in reward function: the problem's dataset scores the answer.

    correct: full score (1.0; scores are clamped to [0, 1]); wrong: anything less, with the
    dataset's partial credit as the score (many give 0.01 for an answer in the right form);
    unparsable: the scorer raised on the answer (prime_factorization's does on anything but
    "a × b"); no_answer: nothing to read.
    """
    if not getattr(problem, "meta", ""):
        raise ValueError(
            f"problem {problem.uid} carries no reasoning-gym entry (Problem.meta): "
            "reward.fn=reasoning_gym scores only problems of data.task=reasoning_gym"
        )
    answer = read_answer(completion)
    if answer is None:
        return Verdict(status="no_answer")
    name, config, entry = load_meta(problem.meta)
    scorer = dataset(name, config)
    try:
        score = float(scorer.score_answer(answer, entry))
    except Exception as e:  # the answer broke the dataset's parser: a malformed answer
        detail = f"{name} cannot read the answer: {type(e).__name__}: {' '.join(str(e).split())}"
        return Verdict(status="unparsable", predicted=answer, detail=detail[:300])
    # Clamped: a few scorers sum 1/n floats past 1 (spell_backward's 1.0000000000000002).
    score = min(max(score, 0.0), 1.0)
    status = "correct" if score >= 1.0 else "wrong"
    return Verdict(status=status, score=score, predicted=answer)
