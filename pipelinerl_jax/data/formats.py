"""Built-in record formats: how a raw dataset record becomes a `Problem` (question, gold answer).

A format names where the question and the answer live in a record (dotted paths, list indices
allowed, several candidates tried in order) and how the gold answer is extracted from that
field: GSM8K keeps what follows `####`, MATH takes the last `\\boxed{...}` of the solution
(nested braces included), AIME/AMC normalise numeric answers ("033", "142.0" -> "33", "142").
A record that lacks the field or whose answer cannot be extracted is rejected with a reason,
so the loader can skip it and count it instead of failing the run.

Gold extraction uses rewards/boxed.py's `last_boxed`, the function the math reward reads a
completion's answer with: a gold answer and a completion are read the same way.
"""

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.boxed import last_boxed


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt of a dataset; what the data iterator yields and reward functions receive."""

    uid: str  # stable id, "<source>/<row>": the same problem has the same uid on resume
    question: str  # the problem statement (the user message; prompts.py adds the template)
    answer: str  # the gold answer as text, e.g. "72" or "\\frac{1}{2}"
    source: str  # dataset or task name, for per-dataset metrics and reward dispatch
    epoch: int = 0  # set by the iterator: the pass over the data this draw belongs to
    index: int = -1  # set by the iterator: position in this shard's stream (0, 1, 2, ...)
    meta: str = ""  # what the task's reward needs beyond the gold, as JSON text ("" for most;
    #   reasoning_gym: the dataset, its config and the entry its scorer reads)


def get_path(record: Any, path: str) -> Any:
    """record["a"]["b"][0] for path "a.b.0"; raises KeyError when any step is missing."""
    value = record
    for part in path.split("."):
        if isinstance(value, dict):
            if part not in value:
                raise KeyError(path)
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.lstrip("-").isdigit():
            idx = int(part)
            if not -len(value) <= idx < len(value):
                raise KeyError(path)
            value = value[idx]
        else:
            raise KeyError(path)
    return value


def first_present(record: Any, paths: tuple[str, ...]) -> Any:
    """Value at the first of `paths` present in record; KeyError naming them all otherwise."""
    return first_present_path(record, paths)[1]


def first_present_path(record: Any, paths: tuple[str, ...]) -> tuple[str, Any]:
    """(path, value) of the first of `paths` present in record; KeyError naming them all."""
    for path in paths:
        try:
            return path, get_path(record, path)
        except KeyError:
            continue
    raise KeyError(" or ".join(repr(p) for p in paths))


def _as_text(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return value.strip() or None
    return None


def answer_as_is(value: Any) -> str | None:
    return _as_text(value)


def gsm8k_answer(value: Any) -> str | None:
    """GSM8K solutions end with "#### 1,234": the gold is what follows, without commas."""
    text = _as_text(value)
    if text is None or "####" not in text:
        return None
    gold = text.rsplit("####", 1)[1].strip().replace(",", "")
    return gold or None


def boxed_answer(value: Any) -> str | None:
    """MATH-style solutions: the gold is the content of the last \\boxed{}."""
    text = _as_text(value)
    if text is None:
        return None
    gold = last_boxed(text)
    return gold.strip() if gold and gold.strip() else None


def numeric_answer(value: Any) -> str | None:
    """AIME/AMC answers: numbers, stored as int, float ("142.0") or zero-padded text ("033")."""
    text = _as_text(value)
    if text is None:
        return None
    if re.fullmatch(r"-?\d+", text):
        return str(int(text))
    if re.fullmatch(r"-?\d+\.0+", text):
        return str(int(float(text)))
    return text


@dataclasses.dataclass(frozen=True)
class Format:
    """Where a record keeps its question and answer, and how to read the gold from the answer."""

    name: str
    question_fields: tuple[str, ...]
    answer_fields: tuple[str, ...]
    extract_answer: Callable[[Any], str | None]
    description: str
    # A fallback answer field that holds something else than the answer itself reads it its
    # own way: MATH-500's "solution" (when a record lacks "answer") is a worked solution whose
    # gold is its last \\boxed{}, not the whole text.
    field_extractors: tuple[tuple[str, Callable[[Any], str | None]], ...] = ()

    def extractor(self, path: str) -> Callable[[Any], str | None]:
        return dict(self.field_extractors).get(path, self.extract_answer)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "fields",
            ("question",),
            ("answer",),
            answer_as_is,
            "generic: question/answer fields (remap them with question_field/answer_field)",
        ),
        Format(
            "gsm8k",
            ("question",),
            ("answer",),
            gsm8k_answer,
            "GSM8K: the gold follows '####' in the answer",
        ),
        Format(
            "math",
            ("problem",),
            ("solution",),
            boxed_answer,
            "MATH (Hendrycks): the gold is the last \\boxed{} of the solution",
        ),
        Format(
            "math500",
            ("problem",),
            ("answer", "solution"),
            answer_as_is,
            "MATH-500: the 'answer' field (LaTeX, no \\boxed), else the last \\boxed{} of "
            "the solution",
            field_extractors=(("solution", boxed_answer),),
        ),
        Format(
            "orz",
            ("0.value",),
            ("1.ground_truth.value",),
            answer_as_is,
            "Open-Reasoner-Zero: [{'from': 'human', 'value': Q}, "
            "{'from': 'assistant', 'ground_truth': {'value': A}}]",
        ),
        Format(
            "aime",
            ("problem", "Problem", "question"),
            ("answer", "Answer"),
            numeric_answer,
            "AIME/AMC: problem + numeric answer (zero padding and '.0' removed)",
        ),
    )
}
FORMATS["amc"] = dataclasses.replace(FORMATS["aime"], name="amc")


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ConfigError(f"unknown dataset format {name!r}; choose one of {sorted(FORMATS)}")
    return FORMATS[name]


def to_problem(
    record: Any,
    fmt: Format,
    *,
    source: str,
    row: int,
    question_fields: tuple[str, ...] | None = None,
    answer_fields: tuple[str, ...] | None = None,
) -> Problem | str:
    """The record as a Problem, or a short reason why it must be skipped."""
    q_paths = question_fields or fmt.question_fields
    a_paths = answer_fields or fmt.answer_fields
    try:
        question = _as_text(first_present(record, q_paths))
    except KeyError as e:
        return f"missing question field {e.args[0]}"
    if question is None:
        return "empty or non-text question"
    try:
        a_path, raw_answer = first_present_path(record, a_paths)
    except KeyError as e:
        return f"missing answer field {e.args[0]}"
    answer = fmt.extractor(a_path)(raw_answer)
    if answer is None:
        return f"no gold answer extractable ({fmt.name} format)"
    return Problem(uid=f"{source}/{row}", question=question, answer=answer, source=source)
