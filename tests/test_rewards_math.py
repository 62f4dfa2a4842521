"""math-verify statuses on hand-written completions."""

import threading

import pytest

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.rewards.math import math_reward, verify_math


@pytest.mark.parametrize(
    "completion, gold, status",
    [
        # correct, including LaTeX / numeric equivalents
        ("2+2 is \\boxed{4}.", "4", "correct"),
        ("So $x = \\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", "correct"),
        ("\\boxed{0.5}", "\\frac12", "correct"),
        ("\\boxed{\\dfrac{1}{2}}", "1/2", "correct"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", "correct"),
        ("\\boxed{1,000}", "1000", "correct"),
        ("\\boxed{10\\%}", "0.1", "correct"),
        ("\\boxed{\\{3, -3\\}}", "\\{-3, 3\\}", "correct"),
        (
            "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}",
            "\\left( 3, \\frac{\\pi}{2} \\right)",
            "correct",
        ),
        ("\\boxed{3}", "$\\boxed{3}$", "correct"),  # a gold written with its own box
        # the LAST box counts
        ("\\boxed{3} no wait \\boxed{4}", "4", "correct"),
        ("\\boxed{4} no wait \\boxed{3}", "4", "wrong"),
        # wrong
        ("\\boxed{5}", "4", "wrong"),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", "wrong"),
        ("\\boxed{x + 1}", "x + 2", "wrong"),
        # no answer
        ("I think it is 4.", "4", "no_answer"),
        ("the answer is \\boxed{\\frac{1}{2", "\\frac{1}{2}", "no_answer"),  # cut off mid-box
        # unparsable
        ("\\boxed{}", "4", "unparsable"),
        ("\\boxed{@#!}", "4", "unparsable"),
    ],
)
def test_statuses(completion, gold, status):
    verdict = verify_math(completion, gold)
    assert verdict.status == status, verdict
    assert verdict.score == (1.0 if status == "correct" else 0.0)


def test_predicted_and_reward_fn():
    p = Problem(uid="m/0", question="?", answer="\\frac{1}{2}", source="m")
    verdict = math_reward("so \\boxed{\\frac{2}{4}}", p)
    assert verdict.status == "correct" and verdict.predicted == "\\frac{2}{4}"


def test_unparsable_gold_is_an_error_not_a_wrong_answer():
    for gold in ("", "\\boxed{}", "$\\boxed{ }$"):
        verdict = verify_math("\\boxed{4}", gold)
        assert verdict.status == "error" and "gold answer" in verdict.detail


def test_text_gold_compares_as_text():
    assert verify_math("\\boxed{north-east}", "north-east").status == "correct"
    assert verify_math("\\boxed{south-west}", "north-east").status != "correct"


def test_works_off_the_main_thread():
    # math-verify's own timeout uses SIGALRM and raises off the main thread; ours is disabled.
    out = []
    t = threading.Thread(target=lambda: out.append(verify_math("\\boxed{0.5}", "1/2")))
    t.start()
    t.join(timeout=30)
    assert out and out[0].status == "correct"
