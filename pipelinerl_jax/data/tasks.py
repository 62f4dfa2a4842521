"""Built-in procedural tasks with verifiable rewards, for tiny models trained from scratch.

The default run learns "reverse a string of 1-5 digits": prompt `<bos>12345=`, answer
`54321<eos>`. Every character is one token of a 16-token vocabulary (3 specials, 10 digits,
`+ = :`), so a ~0.4M-parameter decoder can learn it on CPU in minutes. The reward is partial
credit: correct positions / the longer of completion and answer, so a random policy earns a
little (about 0.03) and every improvement is visible, unlike an all-or-nothing reward.

Problem i of a task is generated from (task seed, i) alone, so a task is a random-access
source of `num_problems` problems: the same `PromptStream` that serves file datasets shuffles,
shards, repeats and checkpoints it. Alternatives with the same vocabulary: `copy_digits`
(easier) and `add_numbers` (harder; it plateaus early at this model size). `guess_number` is
the multi-turn toy: the same question every time, a secret answer, and the "guess"
environment's "<" / ">" feedback between the model's guesses.

Text tasks, for real models with their own tokenizer: `word_problems` (word_problems.py) and
`reasoning_gym`, any reasoning-gym dataset (reasoning_gym_task.py).
"""

import abc
import dataclasses
import random
from typing import ClassVar

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.data.procedural import ProceduralSource
from pipelinerl_jax.data.reasoning_gym_task import TASK_NAME as REASONING_GYM
from pipelinerl_jax.data.reasoning_gym_task import ReasoningGym
from pipelinerl_jax.data.word_problems import WordProblems
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.tables import partial_credit

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
TASK_CHARS = "0123456789+=:"


class CharTokenizer:
    """One token per character; the Hugging Face calls the pipeline uses, nothing more."""

    def __init__(self, chars: str = TASK_CHARS):
        if len(set(chars)) != len(chars):
            raise ConfigError(f"tokenizer characters {chars!r} contain duplicates")
        self.tokens = SPECIAL_TOKENS + tuple(chars)
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self._ids = {ch: i + len(SPECIAL_TOKENS) for i, ch in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_token_id(self) -> int:
        return len(self.tokens) - 1

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Stop ids, as models/tokenizer.Tokenizer names them."""
        return (self.eos_token_id,)

    def token_to_id(self, token: str) -> int | None:
        if token in SPECIAL_TOKENS:
            return SPECIAL_TOKENS.index(token)
        return self._ids.get(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text, preceded by <bos> when add_special_tokens."""
        try:
            ids = [self._ids[ch] for ch in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} of {text[:40]!r} is not in the task "
                f"vocabulary {''.join(self._ids)!r}"
            ) from None
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of ids; special tokens appear by name unless skip_special_tokens."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"token id {i} is outside the vocabulary [0, {len(self.tokens)})")
            if i < len(SPECIAL_TOKENS) and skip_special_tokens:
                continue
            out.append(self.tokens[i])
        return "".join(out)

    def apply_chat_template(
        self, messages, add_generation_prompt: bool = True, tokenize: bool = False
    ):
        """The messages' contents concatenated: task prompts already end with their separator.

        A tiny model has no roles, so there is no markup; use the plain prompt template with
        no system prompt for tasks (a system prompt's letters are not in the vocabulary).
        """
        del add_generation_prompt  # the separator ending each question is the generation cue
        text = "".join(m["content"] for m in messages)
        return self.encode(text) if tokenize else text


@dataclasses.dataclass(frozen=True)
class DigitTask(abc.ABC):
    """A procedurally generated task over digit strings; subclasses define `make`."""

    name: ClassVar[str] = ""
    separator: ClassVar[str] = "="
    text_task: ClassVar[bool] = False  # False: its own character tokenizer, plain prompts
    min_digits: int = 1  # digits per problem, at least ...
    max_digits: int = 5  # ... and at most
    num_problems: int = 100_000  # the epoch size of the stream
    seed: int = 0  # what the problems are; the stream's seed is their order

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits <= 32:
            raise ConfigError(
                f"task {self.name}: need 1 <= min_digits ({self.min_digits}) <= "
                f"max_digits ({self.max_digits}) <= 32"
            )
        if self.num_problems < 1:
            raise ConfigError(f"task {self.name}: num_problems={self.num_problems} must be >= 1")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"task {self.name}: seed {self.seed} must be in [0, 2**32)")

    @property
    def tokenizer(self) -> CharTokenizer:
        return _TOKENIZER

    def _digits(self, rng: random.Random, n: int, leading_zero: bool = True) -> str:
        first = rng.randrange(0 if leading_zero else 1, 10)
        return str(first) + "".join(str(rng.randrange(10)) for _ in range(n - 1))

    @abc.abstractmethod
    def make(self, rng: random.Random) -> tuple[str, str]:
        """(question, answer) drawn from rng."""

    def problem(self, i: int) -> Problem:
        if not 0 <= i < self.num_problems:
            raise IndexError(f"problem {i} outside [0, {self.num_problems})")
        # An int seed makes random.Random reproducible across processes and Python versions.
        question, answer = self.make(random.Random((self.seed << 40) | i))
        return Problem(uid=f"{self.name}/{i}", question=question, answer=answer, source=self.name)

    def source(self) -> "ProceduralSource":
        return ProceduralSource(self)

    @property
    def max_prompt_tokens(self) -> int:
        """<bos> + the longest question."""
        return 1 + self._max_question_chars()

    @property
    def max_answer_tokens(self) -> int:
        """The longest answer + <eos>."""
        return self._max_answer_chars() + 1

    def _max_question_chars(self) -> int:
        return self.max_digits + 1

    def _max_answer_chars(self) -> int:
        return self.max_digits

    def score(self, problem: Problem, completion: str) -> float:
        return partial_credit(completion, problem.answer)


@dataclasses.dataclass(frozen=True)
class ReverseDigits(DigitTask):
    """'12345=' -> '54321'. The default run's task."""

    name: ClassVar[str] = "reverse_digits"

    def make(self, rng):
        s = self._digits(rng, rng.randint(self.min_digits, self.max_digits))
        return s + self.separator, s[::-1]


@dataclasses.dataclass(frozen=True)
class CopyDigits(DigitTask):
    """'12345:' -> '12345'. A sanity task: learnable by attending one offset back."""

    name: ClassVar[str] = "copy_digits"
    separator: ClassVar[str] = ":"

    def make(self, rng):
        s = self._digits(rng, rng.randint(self.min_digits, self.max_digits))
        return s + self.separator, s


@dataclasses.dataclass(frozen=True)
class AddNumbers(DigitTask):
    """'123+45=' -> '168'. Numbers of min..max digits each, no leading zeros."""

    name: ClassVar[str] = "add_numbers"
    max_digits: int = 3

    def make(self, rng):
        a = self._digits(rng, rng.randint(self.min_digits, self.max_digits), leading_zero=False)
        b = self._digits(rng, rng.randint(self.min_digits, self.max_digits), leading_zero=False)
        return f"{a}+{b}=", str(int(a) + int(b))

    def _max_question_chars(self):
        return 2 * self.max_digits + 2

    def _max_answer_chars(self):
        return self.max_digits + 1


@dataclasses.dataclass(frozen=True)
class GuessNumberTask(DigitTask):
    """'0:15=' with a secret answer: the problems of a multi-turn game (envs/guess.py, env
    "guess" answering ">" for higher and "<" for lower). Every question is the same; only the
    secret differs, so one answer cannot fit them all and the model must use the feedback.
    The vocabulary has the base-16 digits a-f too, so a guess can be one character. Scored
    alone (no environment), an answer is partial credit against the secret."""

    name: ClassVar[str] = "guess_number"
    lo: int = 0  # the smallest secret
    hi: int = 15  # the largest secret

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.lo < self.hi < 10**self.max_digits:
            raise ConfigError(
                f"task {self.name}: need 0 <= lo ({self.lo}) < hi ({self.hi}) < "
                f"10**max_digits ({10**self.max_digits})"
            )

    @property
    def tokenizer(self) -> CharTokenizer:
        return _GUESS_TOKENIZER

    def make(self, rng):
        return f"{self.lo}:{self.hi}=", str(rng.randint(self.lo, self.hi))

    def _max_question_chars(self):
        return len(f"{self.lo}:{self.hi}=")

    def _max_answer_chars(self):
        return len(str(self.hi))


_TOKENIZER = CharTokenizer()
_GUESS_TOKENIZER = CharTokenizer(TASK_CHARS + "<>abcdef")
Task = DigitTask | WordProblems | ReasoningGym
# WordProblems and ReasoningGym are text tasks (text_task = True): the run uses the model's own
# tokenizer. ReasoningGym's `name` field is the reasoning-gym dataset, so it is keyed here.
TASKS: dict[str, type[Task]] = {
    **{t.name: t for t in (ReverseDigits, CopyDigits, AddNumbers, GuessNumberTask, WordProblems)},
    REASONING_GYM: ReasoningGym,
}


def make_task(name: str, /, **kwargs) -> Task:
    """The task called `name`, e.g. make_task("reverse_digits", max_digits=5, seed=0).

    A task with an `options_field` (reasoning_gym: "config") takes options it does not know
    into that dict: make_task("reasoning_gym", name="chain_sum", min_terms=3) is
    make_task("reasoning_gym", name="chain_sum", config={"min_terms": 3})."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    cls = TASKS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - fields)
    into = getattr(cls, "options_field", None)
    if unknown and into:
        extra = {k: kwargs.pop(k) for k in unknown}
        kwargs[into] = {**(kwargs.get(into) or {}), **extra}
    elif unknown:
        raise ConfigError(f"task {name}: unknown option(s) {unknown}; valid: {sorted(fields)}")
    return cls(**kwargs)


def held_out_problems(name: str, options: dict, n: int) -> list[Problem]:
    """n problems of task `name` that a run with these options never trains on: the test split
    of a task that has splits (disjoint question texts), else the task under another seed."""
    task = make_task(name, **options)
    if hasattr(task, "split"):
        task = make_task(name, **{**options, "split": "test"})
    else:
        task = make_task(name, **{**options, "seed": options.get("seed", 0) + 7919})
    return [task.problem(i) for i in range(min(n, task.num_problems))]
