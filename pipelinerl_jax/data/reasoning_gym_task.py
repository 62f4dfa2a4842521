"""Any reasoning-gym dataset as a text task, scored by the dataset's own scorer.

    data.task = "reasoning_gym"
    data.task_options = {"name": "chain_sum", "size": 10000, "seed": 0,
                         "config": {"min_terms": 2, "max_terms": 4}}
    reward.fn = "reasoning_gym"

`name` is one of reasoning-gym's ~100 datasets (reasoning_gym.factory.DATASETS), `config` its
own options (its config dataclass's fields but seed and size, which are the task's). Problem i
of the train split is entry i of `reasoning_gym.create_dataset(name, seed=seed, size=size,
**config)`, unless that entry's question belongs to the held-out share: then another entry of
the same dataset stands in for it (a few of the `size` entries appear twice per epoch).

Held out (`split="test"`, what the run's evaluation and `evaluate --task` use): entries of the
same dataset under seed + size. reasoning-gym draws entry i of seed s from Random(s + i), so
those seeds are not the training ones, but a small dataset still repeats questions across
seeds (chain_sum with 2 one-digit terms has a few hundred); so the splits also partition the
question texts by a hash of the text, as word_problems does: one text in 8 belongs to the test
split, whatever the seed, and a test question can never be a train question.

A problem carries the dataset's name and config and its entry in `Problem.meta`, and the
`reasoning_gym` reward (rewards/reasoning_gym_scorer.py, which says why) scores the answer read
from the completion with the dataset's `score_answer`: the last `<answer>...</answer>`, as
reasoning-gym's own prompts ask (set `data.system_prompt` to `reasoning_gym_scorer.SYSTEM_PROMPT`
for them), else the last `\\boxed{}`, as the run's default system prompt asks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import ClassVar

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.data.procedural import ProceduralSource
from pipelinerl_jax.errors import ConfigError

TASK_NAME = "reasoning_gym"
SPLITS = ("train", "test")
_TEST_SHARE = 8  # 1 in 8 question texts belongs to the test split
_MAX_DRAWS = 256  # entries tried for one problem of the wanted split before giving up
_SEED_LIMIT = 2**32  # some datasets seed numpy with seed + index, which must stay below this


def _scorer():
    """rewards/reasoning_gym_scorer.py, imported on first use."""
    # Deferred: reasoning_gym takes seconds to import (matplotlib, through cellpylib) and every
    # run imports data.tasks; only a run or a script that builds this task pays for it.
    from pipelinerl_jax.rewards import reasoning_gym_scorer

    return reasoning_gym_scorer


def in_test_split(question: str) -> bool:
    """Whether a question text belongs to the test split (1 in _TEST_SHARE texts): a stable hash
    of the text itself, so the same in every process and for every seed."""
    digest = hashlib.sha1(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") % _TEST_SHARE == 0


def _stand_in(i: int, k: int, size: int) -> int:
    """The index of the k-th entry tried for problem i (k >= 1), the same in every process."""
    digest = hashlib.sha1(f"{i}/{k}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % size


@dataclasses.dataclass(frozen=True)
class ReasoningGym:
    """A reasoning-gym dataset as a text task; see the module docstring."""

    text_task: ClassVar[bool] = True  # no tokenizer of its own: the model's and its chat
    reward_fn: ClassVar[str] = "reasoning_gym"  # the dataset's score_answer
    options_field: ClassVar[str] = "config"  # make_task puts options it does not know here
    name: str = ""  # the reasoning-gym dataset, e.g. "chain_sum"
    size: int = 100_000  # entries of the dataset: the epoch size
    seed: int = 0  # what the problems are; the stream's seed is their order
    config: dict = dataclasses.field(default_factory=dict)  # the dataset's own options, e.g.
    #   {"min_terms": 2} (not seed and size: the task's)
    split: str = "train"  # "train" or "test": disjoint question texts

    def __post_init__(self):
        where = f"task {TASK_NAME}"
        config = self.config
        if hasattr(config, "to_dict"):  # an ml_collections.ConfigDict
            config = config.to_dict()
        if not isinstance(config, dict):
            raise ConfigError(
                f"{where}: config={config!r} must be a dict of the dataset's options, "
                'e.g. {"min_terms": 2}'
            )
        if not self.name:
            raise ConfigError(
                f"{where}: set task_options name to a reasoning-gym dataset, e.g. "
                '{"name": "chain_sum"}'
            )
        owned = sorted({"seed", "size"} & set(config))
        if owned:
            raise ConfigError(
                f"{where}: config.{owned[0]} is the task's own option; set task_options "
                f"{owned[0]} instead"
            )
        if not isinstance(self.size, int) or not 1 <= self.size <= _SEED_LIMIT // 2:
            raise ConfigError(f"{where}: size={self.size!r} must be an integer in [1, 2**31]")
        if (
            not isinstance(self.seed, int)
            or self.seed < 0
            or self.seed + 2 * self.size > _SEED_LIMIT
        ):
            raise ConfigError(
                f"{where}: seed={self.seed!r} must be >= 0 with seed + 2 * size <= 2**32 "
                "(the held-out problems use seeds seed + size onwards)"
            )
        if self.split not in SPLITS:
            raise ConfigError(f"{where}: split={self.split!r} must be 'train' or 'test'")
        scorer = _scorer()
        try:  # sorted keys, tuples kept: equal configs are equal tasks (and fingerprints)
            config = scorer.decode(json.loads(scorer.canonical_config(config)))
        except TypeError as e:
            raise ConfigError(f"{where}: config {config!r} is not JSON-able data: {e}") from None
        object.__setattr__(self, "config", config)  # frozen: the normalised copy
        scorer.dataset(self.name, self.dataset_config)  # a bad name or option fails here

    @property
    def num_problems(self) -> int:
        return self.size

    @property
    def dataset_seed(self) -> int:
        """The seed of the dataset this split draws from: seed, or seed + size when held out."""
        return self.seed + (self.size if self.split == "test" else 0)

    @property
    def dataset_config(self) -> dict:
        """create_dataset's keyword arguments for this split (seed and size included)."""
        return {**self.config, "seed": self.dataset_seed, "size": self.size}

    def entry(self, i: int) -> tuple[int, dict]:
        """(dataset index, entry) of problem i: entry i, or the first stand-in in this split."""
        if not 0 <= i < self.size:
            raise IndexError(f"problem {i} outside [0, {self.size})")
        dataset = _scorer().dataset(self.name, self.dataset_config)
        want_test = self.split == "test"
        for k in range(_MAX_DRAWS):
            index = i if k == 0 else _stand_in(i, k, self.size)
            entry = dataset[index]
            if in_test_split(entry["question"]) == want_test:
                return index, entry
        raise ConfigError(
            f"task {TASK_NAME}: no {self.split} question for problem {i} in {_MAX_DRAWS} "
            f"entries of {self.name}: its questions are too few to hold one in "
            f"{_TEST_SHARE} out; widen its config or raise size"
        )

    def problem(self, i: int) -> Problem:
        index, entry = self.entry(i)
        answer = entry.get("answer")
        metadata = entry.get("metadata")
        # composite's entries name the dataset they came from: per-dataset eval metrics
        origin = metadata.get("source_dataset", self.name) if isinstance(metadata, dict) else ""
        return Problem(
            uid=f"{TASK_NAME}/{self.name}/{self.split}/{i}",
            question=entry["question"],
            answer="" if answer is None else str(answer),
            source=f"{TASK_NAME}/{origin or self.name}",
            meta=_scorer().dump_meta(self.name, self.dataset_config, index, entry),
        )

    def source(self) -> ProceduralSource:
        """Random-access view of the problems (len, [i], fingerprint) for PromptStream."""
        return ProceduralSource(self)

    def longest_question_chars(self, n: int = 200) -> int:
        """Length of the longest of the first n questions: a guide for prompt budgets."""
        return max(len(self.entry(i)[1]["question"]) for i in range(min(n, self.size)))
