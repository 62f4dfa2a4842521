"""GSM8K-format arithmetic word problems from a seeded procedural generator.

    python -m pipelinerl_jax.data.word_problems --split=test --n=500 --difficulty=1 \\
        --out=word_problems_test.jsonl [--kinds=shopping,ages --max_value=0 --seed=0]

A real small instruct model (SmolLM2-135M) almost never solves GSM8K, so RL on it gets no
signal. These problems have the same shape (a short story, an integer answer, a worked
solution ending in `#### N`) but a chosen difficulty:

  1  one operation on small numbers, in one or two sentences
     ("Tom has 5 apples and buys 3 more. How many apples does Tom have now?")
  2  two operations
  3  three or four operations with larger numbers, like GSM8K

Kinds (`KINDS`): inventory (has, gets, gives away), shopping (totals and change), sharing
(exact division), rates (rate x time), groups (equal groups, legs, shelves), comparison (more,
fewer, times as many), fractions (fractions and percentages of whole numbers), ages. Every
intermediate value and every answer is a non-negative integer: divisions are built from their
quotient, so they are always exact.

Problem i of a split is drawn from random.Random(seed, split, i) alone (an int seed, so the
same in every process), which makes the task a random-access source like the digit tasks of
tasks.py. The splits partition the space of question texts by a hash of the text: a test
question can never be a train question, for any seed or index. The reward is math-verify on
the completion's last \\boxed{} (`rewards/math.py`); the task has no tokenizer of its own
(`text_task = True`): the run uses the model's tokenizer and chat prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import ClassVar

from absl import flags

from pipelinerl_jax import cli
from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.data.procedural import ProceduralSource
from pipelinerl_jax.data.word_problem_kinds import KINDS, Draw
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.math import verify_math

SPLITS = ("train", "test")
DEFAULT_MAX_VALUE = {1: 10, 2: 20, 3: 100}  # difficulty -> largest base quantity drawn
_TEST_SHARE = 8  # 1 in 8 question texts belongs to the test split
_MAX_DRAWS = 10_000  # draws to find a question of the wanted split before giving up
_MAX_PROBLEMS = 2**40  # problem indices share the generator seed with (seed, split)


def _in_test_split(question: str) -> bool:
    """Whether a question text belongs to the test split (1 in _TEST_SHARE texts).

    A stable hash of the text itself (not Python's salted hash()), so the split of a text is
    the same in every process and for every seed: the two splits can never share a question.
    """
    digest = hashlib.sha1(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") % _TEST_SHARE == 0


@dataclasses.dataclass(frozen=True)
class WordProblems:
    """Procedural GSM8K-style word problems with integer answers; see the module docstring."""

    name: ClassVar[str] = "word_problems"
    text_task: ClassVar[bool] = True  # no tokenizer of its own: the model's and its chat
    reward_fn: ClassVar[str] = "math"  # math-verify on the last \boxed{} (rewards/math.py)
    difficulty: int = 1  # 1: one operation, 2: two, 3: three or four
    kinds: tuple[str, ...] = tuple(KINDS)  # kinds to draw from (names in KINDS)
    max_value: int = 0  # largest base quantity; 0: DEFAULT_MAX_VALUE[difficulty]
    num_problems: int = 100_000  # the epoch size of the stream
    seed: int = 0  # what the problems are; the stream's seed is their order
    split: str = "train"  # "train" or "test": disjoint question texts

    def __post_init__(self):
        kinds = self.kinds
        if isinstance(kinds, str):  # "shopping,ages" from a flag or a config string
            kinds = tuple(k.strip() for k in kinds.split(",") if k.strip())
        kinds = tuple(kinds)
        object.__setattr__(self, "kinds", kinds)  # frozen: normalise lists to a hashable tuple
        where = f"task {self.name}"
        if isinstance(self.difficulty, bool) or self.difficulty not in (1, 2, 3):
            raise ConfigError(
                f"{where}: difficulty={self.difficulty!r} must be 1 (one "
                "operation), 2 (two) or 3 (three or four)"
            )
        if not kinds:
            raise ConfigError(f"{where}: kinds is empty; name at least one of {list(KINDS)}")
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise ConfigError(f"{where}: unknown kind(s) {unknown}; choose from {list(KINDS)}")
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"{where}: kinds {list(kinds)} repeat a name; list each once")
        if not (self.max_value == 0 or 5 <= self.max_value <= 1_000_000):
            raise ConfigError(
                f"{where}: max_value={self.max_value} must be 0 (the "
                "difficulty's default) or in [5, 1000000]"
            )
        if not 1 <= self.num_problems <= _MAX_PROBLEMS:
            raise ConfigError(f"{where}: num_problems={self.num_problems} must be in [1, 2**40]")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"{where}: seed {self.seed} must be in [0, 2**32)")
        if self.split not in SPLITS:
            raise ConfigError(f"{where}: split={self.split!r} must be 'train' or 'test'")

    @property
    def top(self) -> int:
        """The largest base quantity (count, price, rate) a problem draws."""
        return self.max_value or DEFAULT_MAX_VALUE[self.difficulty]

    def _generate(self, i: int) -> tuple[str, list[str], int, str]:
        """(question, solution lines, answer, kind) of problem i."""
        if not 0 <= i < self.num_problems:
            raise IndexError(f"problem {i} outside [0, {self.num_problems})")
        # An int seed makes random.Random reproducible across processes and Python versions;
        # the split is part of it so that test problem i is not drawn like train problem i.
        rng = random.Random((self.seed << 41) | (SPLITS.index(self.split) << 40) | i)
        want_test = self.split == "test"
        for _ in range(_MAX_DRAWS):
            draw = Draw(rng, self.difficulty, self.top)
            kind = self.kinds[rng.randrange(len(self.kinds))]
            question = KINDS[kind](draw)
            if _in_test_split(question) == want_test:
                return question, draw.lines, draw.value, kind
        raise ConfigError(
            f"task {self.name}: no {self.split} question in {_MAX_DRAWS} draws "
            f"(kinds {list(self.kinds)} are too narrow); add kinds or raise "
            "max_value"
        )

    def problem(self, i: int) -> Problem:
        question, _, answer, _ = self._generate(i)
        return Problem(
            uid=f"word_problems/{self.split}/{i}",
            question=question,
            answer=str(answer),
            source=self.name,
        )

    def solution(self, i: int) -> str:
        """GSM8K-style worked solution of problem i: one calculation a line, then `#### N`."""
        _, lines, answer, _ = self._generate(i)
        return "\n".join(lines) + f"\n#### {answer}"

    def kind(self, i: int) -> str:
        """The kind of problem i (a name in KINDS), e.g. for per-kind accuracy."""
        return self._generate(i)[3]

    def to_gsm8k_records(self, n: int) -> list[dict]:
        """The first n problems as GSM8K JSONL records: {"question", "answer": solution}."""
        if not 1 <= n <= self.num_problems:
            raise ConfigError(
                f"task {self.name}: n={n} must be in [1, num_problems={self.num_problems}]"
            )
        records = []
        for i in range(n):
            question, lines, answer, _ = self._generate(i)
            records.append({"question": question, "answer": "\n".join(lines) + f"\n#### {answer}"})
        return records

    def source(self):
        """Random-access view of the problems (len, [i], fingerprint) for PromptStream."""
        return ProceduralSource(self)

    def longest_question_chars(self, n: int = 2000) -> int:
        """Length of the longest of the first n questions: a guide for prompt budgets."""
        return max(len(self._generate(i)[0]) for i in range(min(n, self.num_problems)))

    def score(self, problem: Problem, completion: str) -> float:
        """1 when the completion's last \\boxed{} equals the gold (math-verify), else 0."""
        return verify_math(completion, problem.answer).score


# --- command line ----------------------------------------------------------------------------


def define_flags(fv: flags.FlagValues) -> None:
    def d(define, *args, **kwargs):
        define(*args, flag_values=fv, **kwargs)

    d(flags.DEFINE_string, "out", None, "Output JSONL file (GSM8K records: question, answer).")
    d(flags.DEFINE_string, "split", "train", "Split: train or test (disjoint questions).")
    d(flags.DEFINE_integer, "n", 1000, "Problems to write: the split's first n.")
    d(flags.DEFINE_integer, "difficulty", 1, "1: one operation, 2: two, 3: three or four.")
    d(flags.DEFINE_list, "kinds", list(KINDS), "Kinds to draw from, comma-separated.")
    d(
        flags.DEFINE_integer,
        "max_value",
        0,
        f"Largest base quantity; 0: the difficulty's default {DEFAULT_MAX_VALUE}.",
    )
    d(flags.DEFINE_integer, "seed", 0, "Task seed: what the problems are.")


def write_records(records: list[dict], out: str) -> None:
    """JSONL, written to a temporary file in the same directory and renamed into place."""
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise ConfigError(
            f"--out={out}: cannot write there ({e.strerror}); choose a path in a writable directory"
        ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        os.unlink(tmp)
        raise ConfigError(
            f"--out={out}: cannot write ({e.strerror}); choose another path "
            "(not a directory, in a writable directory)"
        ) from None
    except BaseException:
        os.unlink(tmp)
        raise


def write_file(fv: flags.FlagValues) -> int:
    """Writes the requested problems; returns how many. ConfigError on bad flags."""
    if not fv.out:
        raise ConfigError("--out is required: the JSONL file to write")
    if fv.n < 1:
        raise ConfigError(f"--n={fv.n} must be >= 1")
    task = WordProblems(
        difficulty=fv.difficulty,
        kinds=tuple(fv.kinds or ()),
        max_value=fv.max_value,
        num_problems=max(fv.n, 1),
        seed=fv.seed,
        split=fv.split,
    )
    write_records(task.to_gsm8k_records(fv.n), fv.out)
    return fv.n


def run_cli(argv: list[str]) -> int:
    """Parses argv (argv[0] is the program name) with fresh flags; returns the exit code."""

    def body(fv):
        n = write_file(fv)
        print(
            f"wrote {n} {fv.split} problems (difficulty {fv.difficulty}) to {fv.out}",
            file=sys.stderr,
        )

    return cli.run(argv, define_flags, body)


def main() -> None:
    sys.exit(run_cli(sys.argv))


if __name__ == "__main__":
    main()
