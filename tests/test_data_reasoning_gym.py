"""The reasoning_gym task: any reasoning-gym dataset by name, its problems, the held-out split
(another seed and disjoint question texts), its scorer through the reward function the pipeline
calls (in a worker process), the exact entry codec, and one-line errors for bad options.

Seeds and datasets are drawn fresh on every run; a failure names them.
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl_jax import config_schema, presets
from pipelinerl_jax.data import reasoning_gym_task
from pipelinerl_jax.data.datasets import PromptStream
from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.data.tasks import TASKS, held_out_problems, make_task
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.pipeline import config_dict
from pipelinerl_jax.rewards import reasoning_gym_scorer as scorer
from pipelinerl_jax.rewards.tables import BUILTIN_REWARDS, reward_fn_spec, task_reward
from pipelinerl_jax.rewards.workers import RewardPool

ROOT = Path(__file__).resolve().parents[1]
# Cheap to build and to draw from, each with a single gold answer that scores 1.0.
FAST = (
    "basic_arithmetic",
    "chain_sum",
    "gcd",
    "lcm",
    "leg_counting",
    "letter_counting",
    "number_sorting",
    "products",
    "spell_backward",
    "word_sorting",
)


def _fresh():
    seed = random.SystemRandom().randrange(2**20)
    return seed, random.Random(seed)


def test_registered_and_text_task_with_its_own_reward():
    assert TASKS["reasoning_gym"] is reasoning_gym_task.ReasoningGym
    task = make_task("reasoning_gym", name="chain_sum", size=10)
    assert task.text_task and task.reward_fn == "reasoning_gym" and task.num_problems == 10
    assert reward_fn_spec("reasoning_gym") == BUILTIN_REWARDS["reasoning_gym"]
    assert len(scorer.dataset_names()) > 90 and "gsm_symbolic" in scorer.dataset_names()


def test_importing_the_tasks_does_not_import_reasoning_gym():
    """reasoning_gym takes seconds to import; every run imports data.tasks."""
    code = "import sys, pipelinerl_jax.data.tasks; print('reasoning_gym' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_options_are_config_fields_with_their_meaning():
    table = config_schema.by_path()
    for key in ("name", "size", "config"):
        field = table[f"data.task_options.{key}"]
        assert field.doc.endswith("(tasks: reasoning_gym)") and len(field.doc) > 40, field
    assert table["data.task_options.config"].default == {}
    assert table["data.task_options.seed"].default == 0  # every task's, reasoning_gym's too
    assert "word_problems, reasoning_gym" in table["data.task_options.split"].doc
    assert "reasoning_gym" not in table["data.task_options.num_problems"].doc  # a property


def test_problems_are_the_datasets_entries():
    seed, rng = _fresh()
    name = rng.choice(FAST)
    task = make_task("reasoning_gym", name=name, size=300, seed=seed)
    dataset = scorer.make_dataset(name, {"seed": seed, "size": 300})
    problems = [task.problem(i) for i in range(300)]
    again = make_task("reasoning_gym", name=name, size=300, seed=seed)
    assert problems == [again.problem(i) for i in range(300)]
    questions = {dataset[j]["question"] for j in range(300)}
    kept = 0
    for i, p in enumerate(problems):
        entry = dataset[i]
        assert p.uid == f"reasoning_gym/{name}/train/{i}" and p.source == f"reasoning_gym/{name}"
        assert not reasoning_gym_task.in_test_split(p.question), (name, seed, i)
        if not reasoning_gym_task.in_test_split(entry["question"]):  # entry i itself ...
            assert (p.question, p.answer) == (entry["question"], str(entry["answer"]))
            kept += 1
        else:  # ... or, for a held-out text, another entry of the same dataset
            assert p.question in questions, (name, seed, i)
    assert 0.7 * 300 < kept < 300, (name, seed, kept)  # one text in 8 is held out
    other = make_task("reasoning_gym", name=name, size=300, seed=seed + 1)
    assert [p.question for p in problems[:20]] != [other.problem(i).question for i in range(20)]


def test_options_flat_or_in_config_and_from_the_run_config():
    seed, _ = _fresh()
    flat = make_task("reasoning_gym", name="chain_sum", seed=seed, min_terms=3, max_terms=3)
    nested = make_task(
        "reasoning_gym", name="chain_sum", seed=seed, config={"max_terms": 3, "min_terms": 3}
    )
    assert flat == nested and flat.source().fingerprint() == nested.source().fingerprint()
    assert all(
        flat.problem(i).question.count(" + ") + flat.problem(i).question.count(" - ") == 2
        for i in range(20)
    )
    # The run config takes the options as data.task_options (dataset options flat or under
    # "config").
    c = presets.tiny_config()
    c.data.task = "reasoning_gym"
    c.data.task_options = {
        "name": "chain_sum",
        "seed": seed,
        "config": {"min_terms": 3, "max_terms": 3},
    }
    c.reward.fn = "reasoning_gym"
    cfg = config_dict.from_config_dict(c)
    assert make_task(cfg.data.task, **dict(cfg.data.task_options)) == nested
    assert json.loads(json.dumps(config_lib.as_dict(cfg)))["data"]["task_options"][0] == [
        "config",
        {"max_terms": 3, "min_terms": 3},
    ]
    c.data.task_options = {"name": "chain_sum", "seed": seed, "min_terms": 3, "max_terms": 3}
    flat_cfg = config_dict.from_config_dict(c)  # the dataset's options flat, as from Python
    assert make_task(flat_cfg.data.task, **dict(flat_cfg.data.task_options)) == nested


def test_held_out_problems_are_another_seed_and_never_training_questions():
    seed, _ = _fresh()
    # Few distinct questions (2 one-digit terms: at most 200), so seeds repeat them often.
    options = {
        "name": "chain_sum",
        "size": 600,
        "seed": seed,
        "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    }
    train = {make_task("reasoning_gym", **options).problem(i).question for i in range(600)}
    held = held_out_problems("reasoning_gym", options, 64)
    assert len(held) == 64 and all(p.uid.startswith("reasoning_gym/chain_sum/test/") for p in held)
    assert not train & {p.question for p in held}, seed
    assert all(json.loads(p.meta)["config"]["seed"] == seed + 600 for p in held)
    # Without the text split the other seed would have repeated training questions.
    other = scorer.make_dataset("chain_sum", {**options["config"], "seed": seed + 600, "size": 600})
    assert train & {other[i]["question"] for i in range(64)}, seed

    # A large space: reasoning-gym's entry i of seed s is Random(s + i), so a held-out seed
    # inside the training window (seed + 7919, say) would replay training entries; seed + size
    # does not, and no held-out question is a training one.
    big = {"name": "chain_sum", "size": 9000, "seed": seed}
    task = make_task("reasoning_gym", **big)
    train = {task.problem(i).question for i in range(9000)}
    held = held_out_problems("reasoning_gym", big, 100)
    assert not train & {p.question for p in held}, seed
    inside = scorer.make_dataset("chain_sum", {"seed": seed + 7919, "size": 9000})
    assert sum(inside[i]["question"] in train for i in range(100)) > 50, seed


def test_stream_and_question_lengths():
    task = make_task("reasoning_gym", name="leg_counting", size=24, split="test")
    stream = PromptStream(task.source(), seed=1)
    epoch = [next(stream) for _ in range(24)]
    assert sorted(p.uid for p in epoch) == sorted(
        f"reasoning_gym/leg_counting/test/{i}" for i in range(24)
    )
    assert 60 < task.longest_question_chars(24) < 1000


def _expected(problem: Problem, answer: str) -> tuple[str, float]:
    """(status, score) of an answer scored here, by the dataset rebuilt from the problem."""
    name, config, entry = scorer.load_meta(problem.meta)
    try:
        score = scorer.make_dataset(name, config).score_answer(answer, entry)
    except Exception:
        return "unparsable", 0.0
    score = min(max(score, 0.0), 1.0)  # spell_backward can give 1.0000000000000002
    return ("correct" if score >= 1.0 else "wrong"), score


def test_reward_in_a_worker_scores_correct_wrong_and_missing_answers():
    seed, rng = _fresh()
    # isomorphic_strings draws differently in another interpreter (set order follows
    # PYTHONHASHSEED), and rearc compares tuples: the carried entry keeps both right.
    names = rng.sample(FAST, 3) + ["isomorphic_strings", "rearc"]
    tasks = [make_task("reasoning_gym", name=n, size=50, seed=seed) for n in names]
    problems = [t.problem(rng.randrange(50)) for t in tasks]
    cases = []
    for p in problems:
        gold = p.answer
        cases += [
            (f"Let me think.\n<answer>{gold}</answer>", p, "correct"),
            (f"So the answer is \\boxed{{{gold}}}.", p, "correct"),
            (f"<answer>{gold}</answer> no, <answer>{gold}9</answer>", p, "as scored here"),
            (f"<answer>{rng.randrange(10**6)}!</answer>", p, "as scored here"),
            ("I have no idea.", p, "no_answer"),
            ("<answer>  </answer>", p, "no_answer"),
        ]
    with RewardPool("reasoning_gym", num_workers=1, timeout_s=60) as pool:
        verdicts = pool.map([(c, p) for c, p, _ in cases])
    statuses = set()
    for (completion, p, want), v in zip(cases, verdicts):
        statuses.add(v.status)
        if want == "correct":  # the gold itself, in tags or boxed
            got = (v.status, v.score, v.predicted)
            assert got == ("correct", 1.0, p.answer.strip()), (seed, p.uid, completion, v)
        elif want == "as scored here":  # the last tag's answer, by the dataset's own scorer
            answer = completion.rsplit("<answer>", 1)[1][: -len("</answer>")]
            assert (v.status, v.score) == _expected(p, answer), (seed, p.uid, completion, v)
        else:
            assert v.status == want, (seed, p.uid, completion, v)
    assert {"correct", "wrong", "no_answer"} <= statuses, (seed, statuses)


def test_unreadable_answer_and_foreign_problem():
    task = make_task("reasoning_gym", name="prime_factorization", size=10)
    p = task.problem(3)
    v = scorer.reasoning_gym_reward("<answer>twelve</answer>", p)
    assert (
        v.status == "unparsable" and v.predicted == "twelve" and "prime_factorization" in v.detail
    )
    assert scorer.reasoning_gym_reward(f"<answer>{p.answer}</answer>", p).status == "correct"
    with pytest.raises(ValueError, match="carries no reasoning-gym entry"):
        scorer.reasoning_gym_reward("<answer>1</answer>", Problem("x/0", "1+0?", "1", "x"))
    # reward.fn="task" (the default) would pay text partial credit: it refuses and says why.
    v = task_reward(p.answer, p)
    assert v.status == "error" and "--config.reward.fn=reasoning_gym" in v.detail


def test_entry_codec_is_exact():
    value = {
        "grid": ((1, 2), (3, 4)),
        "colors": {0: "red", 1: "blue"},
        "seen": {"a", "b"},
        "frozen": frozenset({(1, 2)}),
        "__tuple__": [1],
        "nested": [{"t": (None, True, 1.5, "x")}, []],
        "empty": (),
    }
    back = scorer.decode(json.loads(json.dumps(scorer.encode(value))))
    assert back == value
    assert type(back["grid"][0]) is tuple and type(back["frozen"]) is frozenset
    assert list(back["colors"]) == [0, 1] and type(back["empty"]) is tuple
    with pytest.raises(TypeError, match="object cannot be carried"):
        scorer.encode({"x": object()})
    # Plain JSON would turn rearc's tuple grids into lists, and every right answer would fail.
    task = make_task("reasoning_gym", name="rearc", size=10)
    _, entry = task.entry(0)
    dataset = scorer.make_dataset("rearc", task.dataset_config)
    assert dataset.score_answer(entry["answer"], entry) == 1.0
    assert dataset.score_answer(entry["answer"], json.loads(json.dumps(entry))) < 1.0


@pytest.mark.parametrize(
    "options, match",
    [
        ({"name": "chain_sun"}, r"unknown dataset name='chain_sun'; did you mean chain_sum"),
        ({"name": "nosuch"}, r"e.g. chain_sum, basic_arithmetic"),
        ({}, r"set task_options name to a reasoning-gym dataset"),
        (
            {"name": "chain_sum", "config": {"min_term": 2}},
            r"has no option 'min_term' \(did you mean 'min_terms'\?\)",
        ),
        ({"name": "chain_sum", "max_term": 2}, r"has no option 'max_term'"),
        (
            {"name": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}},
            r"rejects the options .*AssertionError: max_terms must be >= min_terms",
        ),
        ({"name": "chain_sum", "config": {"seed": 3}}, r"config.seed is the task's own option"),
        ({"name": "chain_sum", "config": [1, 2]}, r"must be a dict of the dataset's options"),
        ({"name": "chain_sum", "size": 0}, r"size=0 must be an integer in \[1, 2\*\*31\]"),
        ({"name": "chain_sum", "seed": 2**32 - 10}, r"seed \+ 2 \* size <= 2\*\*32"),
        ({"name": "chain_sum", "split": "dev"}, r"split='dev' must be 'train' or 'test'"),
        ({"name": "composite"}, r"dataset composite rejects .*Must specify at least one dataset"),
    ],
)
def test_bad_options_are_one_line_config_errors(options, match):
    with pytest.raises(ConfigError, match=match) as e:
        make_task("reasoning_gym", **options)
    assert "\n" not in str(e.value)
