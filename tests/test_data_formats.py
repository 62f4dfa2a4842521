"""Record formats: \\boxed{} extraction, dotted field paths, and each built-in loader on its sample."""

import os

import pytest

from pipelinerl_jax.data import formats
from pipelinerl_jax.data.datasets import DatasetSpec, load_dataset
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.boxed import last_boxed

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),
        ("set \\boxed{\\{1, 2\\}} done", "\\{1, 2\\}"),
        ("escaped close \\boxed{\\left\\{ x \\right.}", "\\left\\{ x \\right."),
        ("$\\boxed 5$", "5"),
        ("\\fbox{7}", "7"),
        ("\\boxed {3}", "3"),
        ("no answer here", None),
        ("cut off \\boxed{\\frac{1}{2", None),
        ("\\boxed{}", ""),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_get_path_dicts_and_lists():
    record = [{"value": "q"}, {"ground_truth": {"value": "a"}}]
    assert formats.get_path(record, "0.value") == "q"
    assert formats.get_path(record, "1.ground_truth.value") == "a"
    assert formats.get_path(record, "-1.ground_truth.value") == "a"
    for bad in ("2.value", "0.missing", "x", "0.value.deeper"):
        with pytest.raises(KeyError):
            formats.get_path(record, bad)
    assert formats.first_present({"Problem": 1}, ("problem", "Problem")) == 1


@pytest.mark.parametrize(
    "value, gold",
    [
        ("text\n#### 22", "22"),
        ("#### 1,000", "1000"),
        ("no marker 5", None),
        ("####", None),
    ],
)
def test_gsm8k_answer(value, gold):
    assert formats.gsm8k_answer(value) == gold


@pytest.mark.parametrize(
    "value, gold",
    [
        ("033", "33"),
        (50, "50"),
        (720.0, "720"),
        ("142.0", "142"),
        ("-7", "-7"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        (None, None),
        (True, None),
        ("  ", None),
    ],
)
def test_numeric_answer(value, gold):
    assert formats.numeric_answer(value) == gold


# (file, format, expected (question prefix, gold) of every record)
SAMPLES = [
    (
        "gsm8k.jsonl",
        "gsm8k",
        [("A baker", "22"), ("Mia reads", "80"), ("A school", "1000"), ("Tom has", "9")],
    ),
    (
        "math.jsonl",
        "math",
        [
            ("What is", "\\frac{1}{2}"),
            ("Solve for", "4"),
            ("Find the set", "\\{-3, 3\\}"),
            ("Simplify", "2\\sqrt{3}"),
        ],
    ),
    (
        "math500.jsonl",
        "math500",
        [
            ("Compute", "10"),
            ("Write", "\\frac{1}{3}"),
            ("Convert", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ],
    ),
    (
        "orz.json",
        "orz",
        [("If $a + b", "12"), ("What is the remainder", "2"), ("A fair coin", "\\frac{1}{4}")],
    ),
    (
        "aime.jsonl",
        "aime",
        [("Find the number", "33"), ("Find the remainder", "50"), ("Let $n$", "12")],
    ),
    ("amc.jsonl", "amc", [("What is the sum", "720"), ("How many", "9")]),
]


@pytest.mark.parametrize("filename, fmt, expected", SAMPLES)
def test_each_loader_on_its_sample(filename, fmt, expected):
    loaded = load_dataset(DatasetSpec(path=os.path.join(DATA, filename), format=fmt))
    assert loaded.num_skipped == 0 and loaded.num_records == len(expected)
    stem = os.path.splitext(filename)[0]
    assert loaded.name == stem
    for row, (problem, (prefix, gold)) in enumerate(zip(loaded.problems, expected)):
        assert problem.question.startswith(prefix)
        assert problem.answer == gold
        assert problem.uid == f"{stem}/{row}" and problem.source == stem


def test_math_gold_is_the_last_box_of_the_solution():
    loaded = load_dataset(DatasetSpec(path=os.path.join(DATA, "math.jsonl"), format="math"))
    # The solution of the last record boxes "2" first, then the real answer.
    assert loaded.problems[-1].answer == "2\\sqrt{3}"


def test_math500_without_answer_reads_the_solutions_box():
    # A MATH-500 record that lacks "answer" falls back to "solution": its gold is the last box
    # of the worked solution, not the solution's whole text.
    fmt = formats.get_format("math500")
    solution = "First $\\boxed{2}$ is wrong; so $x = \\boxed{\\frac{1}{3}}$."
    got = formats.to_problem({"problem": "Q", "solution": solution}, fmt, source="m", row=0)
    assert got.answer == "\\frac{1}{3}"
    got = formats.to_problem({"problem": "Q", "solution": "no box"}, fmt, source="m", row=1)
    assert got == "no gold answer extractable (math500 format)"
    # The answer field itself is taken as it is, boxes or not.
    got = formats.to_problem(
        {"problem": "Q", "answer": "7", "solution": solution}, fmt, source="m", row=2
    )
    assert got.answer == "7"


def test_field_overrides_and_unknown_format():
    spec = DatasetSpec(
        path=os.path.join(DATA, "math500.jsonl"),
        format="fields",
        question_field="problem",
        answer_field="unique_id",
        name="m5",
    )
    loaded = load_dataset(spec)
    assert [p.answer for p in loaded.problems][0] == "test/counting/1.json"
    assert loaded.problems[0].uid == "m5/0"
    with pytest.raises(ConfigError, match="unknown dataset format 'gsm9k'"):
        formats.get_format("gsm9k")
