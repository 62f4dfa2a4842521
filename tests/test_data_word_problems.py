"""Word problems: determinism, splits, kinds, difficulty, checked arithmetic, GSM8K files, CLI."""

import collections
import json
import os
import re
import subprocess
import sys

import pytest

from pipelinerl_jax.data import word_problems as wp
from pipelinerl_jax.data.datasets import DatasetSpec, PromptStream, load_dataset
from pipelinerl_jax.data.tasks import DigitTask, make_task
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.math import verify_math

N = 400  # problems per checked (difficulty, split): enough for every kind and template
STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def _check_solution(solution: str, answer: str) -> int:
    """Redoes every "a op b = c" of a worked solution; returns the number of operations."""
    *lines, last = solution.split("\n")
    assert last == f"#### {answer}"
    ops = {
        "+": lambda a, b: a + b,
        "-": lambda a, b: a - b,
        "*": lambda a, b: a * b,
        "/": lambda a, b: a / b,
    }
    for line in lines:
        ((a, op, b, c),) = STEP.findall(line)  # exactly one calculation a line
        assert ops[op](int(a), int(b)) == int(c), line
    assert int(STEP.findall(lines[-1])[0][3]) == int(answer)  # the last step is the answer
    return len(lines)


def test_problems_are_deterministic_and_seeds_differ():
    task = make_task("word_problems", difficulty=2, seed=3)
    again = wp.WordProblems(difficulty=2, seed=3)
    other = wp.WordProblems(difficulty=2, seed=4)
    problems = [task.problem(i) for i in range(50)]
    assert problems == [again.problem(i) for i in range(50)]
    assert [task.solution(i) for i in range(5)] == [again.solution(i) for i in range(5)]
    assert sum(p.question == other.problem(i).question for i, p in enumerate(problems)) < 5
    p = task.problem(17)
    assert p.uid == "word_problems/train/17" and p.source == "word_problems"
    assert wp.WordProblems(split="test").problem(17).uid == "word_problems/test/17"
    with pytest.raises(IndexError):
        wp.WordProblems(num_problems=3).problem(3)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_splits_are_disjoint(difficulty):
    train = wp.WordProblems(difficulty=difficulty, split="train")
    test = wp.WordProblems(difficulty=difficulty, split="test")
    train_questions = {train.problem(i).question for i in range(2000)}
    test_questions = [test.problem(i).question for i in range(300)]
    assert len(set(test_questions)) > 250  # not a handful of repeats
    assert not train_questions & set(test_questions)
    # Even another seed's train split never holds a test question (the hash decides).
    other = {wp.WordProblems(difficulty=difficulty, seed=9).problem(i).question for i in range(500)}
    assert not other & set(test_questions)


@pytest.mark.parametrize("difficulty, steps", [(1, {1}), (2, {2}), (3, {3, 4})])
@pytest.mark.parametrize("split", ["train", "test"])
def test_answers_are_the_solution_arithmetic(difficulty, steps, split):
    task = wp.WordProblems(difficulty=difficulty, split=split, num_problems=N)
    counts = collections.Counter()
    for i, record in enumerate(task.to_gsm8k_records(N)):
        p = task.problem(i)
        assert record["question"] == p.question and record["answer"] == task.solution(i)
        assert re.fullmatch(r"\d+", p.answer) and int(p.answer) >= 1, p
        counts[_check_solution(record["answer"], p.answer)] += 1
    assert set(counts) == steps
    # The question is one or two sentences at difficulty 1 (plus the question itself).
    if difficulty == 1:
        assert all(task.problem(i).question.count(". ") <= 2 for i in range(N))


def test_every_kind_appears_and_kinds_select():
    task = wp.WordProblems(difficulty=1)
    assert len(wp.KINDS) >= 6
    # Each kind alone yields its own questions; together they all appear (~1/8 each).
    signatures = {
        "sharing": "equally|groups of",
        "rates": "every",
        "ages": "years old",
        "fractions": "of them",
        "shopping": r"\$",
    }
    for kind, pattern in signatures.items():
        only = wp.WordProblems(difficulty=1, kinds=(kind,))
        assert all(re.search(pattern, only.problem(i).question) for i in range(40)), kind
    drawn = collections.Counter(task.kind(i) for i in range(400))
    assert set(drawn) == set(wp.KINDS) and min(drawn.values()) > 20
    assert {wp.WordProblems(kinds=("ages", "rates")).kind(i) for i in range(30)} == {
        "ages",
        "rates",
    }
    # Lists and comma strings (flags, configs) become the same tuple.
    assert (
        wp.WordProblems(kinds=["ages", "rates"])
        == wp.WordProblems(kinds="ages, rates")
        == wp.WordProblems(kinds=("ages", "rates"))
    )


def test_questions_are_varied():
    questions = [wp.WordProblems(difficulty=1).problem(i).question for i in range(300)]
    assert len(set(questions)) >= 295
    openings = {" ".join(q.split()[1:3]) for q in questions}  # after the name or "A"/"There"
    assert len(openings) > 30


def _numbers(task, n=300):
    return [int(x) for i in range(n) for x in re.findall(r"\d+", task.problem(i).question)]


def test_difficulty_and_max_value_scale_the_numbers():
    easy, mid, hard = (_numbers(wp.WordProblems(difficulty=d)) for d in (1, 2, 3))
    assert max(easy) <= 100  # d1: quantities up to 10 (a dividend up to 10 x 10)
    assert sum(easy) / len(easy) < sum(mid) / len(mid) < sum(hard) / len(hard)
    assert max(hard) > 100
    bigger = _numbers(wp.WordProblems(difficulty=1, max_value=50, kinds=("inventory",)))
    assert max(_numbers(wp.WordProblems(difficulty=1, kinds=("inventory",)))) <= 10
    assert 10 < max(bigger) <= 50


def test_math_verify_grades_the_gold():
    task = wp.WordProblems(difficulty=3, split="test")
    for i in range(20):
        p = task.problem(i)
        right = verify_math(f"So the answer is \\boxed{{{p.answer}}}.", p.answer)
        wrong = verify_math(f"\\boxed{{{int(p.answer) + 1}}}", p.answer)
        assert right.status == "correct" and wrong.status == "wrong"
        assert task.score(p, f"\\boxed{{{p.answer}}}") == 1.0
    assert task.score(p, "no box") == 0.0


def test_gsm8k_jsonl_round_trip(tmp_path):
    task = wp.WordProblems(difficulty=2, split="test")
    path = tmp_path / "wp.jsonl"
    wp.write_records(task.to_gsm8k_records(60), str(path))
    loaded = load_dataset(DatasetSpec(path=str(path), format="gsm8k"))
    assert loaded.num_skipped == 0 and len(loaded.problems) == 60
    assert [(p.question, p.answer) for p in loaded.problems] == [
        (task.problem(i).question, task.problem(i).answer) for i in range(60)
    ]
    assert os.listdir(tmp_path) == ["wp.jsonl"]  # no temporary file left behind


def test_task_registry_and_stream():
    task = make_task("word_problems", difficulty=1, split="test", num_problems=32)
    assert task.text_task and not DigitTask.text_task
    assert not make_task("reverse_digits").text_task and not hasattr(task, "tokenizer")
    stream = PromptStream(task.source(), seed=1)
    epoch = [next(stream) for _ in range(32)]
    assert sorted(p.uid for p in epoch) == sorted(f"word_problems/test/{i}" for i in range(32))
    assert (
        task.source().fingerprint()
        != make_task("word_problems", difficulty=1, num_problems=32).source().fingerprint()
    )
    assert 40 < task.longest_question_chars(100) < 400


@pytest.mark.parametrize(
    "options, match",
    [
        ({"level": 2}, "unknown option"),
        ({"difficulty": 4}, "difficulty=4 must be 1"),
        ({"difficulty": True}, "difficulty=True"),
        ({"kinds": ("ages", "dragons")}, r"unknown kind\(s\) \['dragons'\]"),
        ({"kinds": ()}, "kinds is empty"),
        ({"kinds": ("ages", "ages")}, "repeat"),
        ({"max_value": 3}, "max_value=3"),
        ({"num_problems": 0}, "num_problems=0"),
        ({"seed": -1}, "seed -1"),
        ({"split": "validation"}, "split='validation'"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ConfigError, match=match):
        make_task("word_problems", **options)


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "pipelinerl_jax.data.word_problems", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )


def test_cli_writes_gsm8k_jsonl(tmp_path):
    out = tmp_path / "sub" / "test.jsonl"
    run = _cli("--split=test", "--n=25", "--difficulty=2", "--kinds=ages,rates", f"--out={out}")
    assert run.returncode == 0, run.stderr
    assert "wrote 25 test problems" in run.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    task = wp.WordProblems(difficulty=2, split="test", kinds=("ages", "rates"))
    assert records == task.to_gsm8k_records(25)
    assert sorted(os.listdir(out.parent)) == ["test.jsonl"]


@pytest.mark.parametrize(
    "args, match",
    [
        (["--kinds=ages,dragons"], "unknown kind"),
        (["--difficulty=0"], "difficulty=0"),
        (["--n=0"], "--n=0"),
        (["--split=dev"], "split='dev'"),
        (["--out=/proc/no/such/dir/x.jsonl"], "cannot write"),
        (["--out="], "--out is required"),
    ],
)
def test_cli_bad_options(tmp_path, capsys, args, match):
    argv = [f"--out={tmp_path / 'x.jsonl'}", *args]
    # In-process (fresh flags each call): fast, and the same code path as the subprocess.
    assert wp.run_cli(["word_problems", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0] and err[0].startswith("error: "), err
    assert not (tmp_path / "x.jsonl").exists()


def test_cli_bad_option_subprocess_one_line(tmp_path):
    run = _cli("--difficulty=7", f"--out={tmp_path / 'x.jsonl'}")
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "difficulty=7 must be 1" in lines[0], run.stderr
    assert not (tmp_path / "x.jsonl").exists()
