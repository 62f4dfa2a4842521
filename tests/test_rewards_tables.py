"""Reward tables by hand, verdict normalisation, and resolving user reward functions."""

import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards import tables
from pipelinerl_jax.rewards.tables import Verdict, as_verdict, get_reward_table
from pipelinerl_jax.rewards.workers import RewardPool

CORRECT = Verdict("correct", 1.0)
WRONG = Verdict("wrong", 0.0)
PARTIAL = Verdict("wrong", 0.4)


@pytest.mark.parametrize(
    "name, verdict, finished, expected",
    [
        ("pure_success", CORRECT, True, 1.0),
        ("pure_success", CORRECT, False, 1.0),
        ("pure_success", WRONG, True, 0.0),
        ("pure_success", PARTIAL, True, 0.4),
        ("pure_success", Verdict("no_answer"), True, 0.0),
        ("pure_success", Verdict("timeout"), True, 0.0),
        ("success_and_format", CORRECT, True, 1.0),
        ("success_and_format", CORRECT, False, 0.9),
        ("success_and_format", WRONG, True, 0.1),
        ("success_and_format", PARTIAL, True, 0.9 * 0.4 + 0.1),
        ("success_and_format", Verdict("unparsable"), True, 0.0),
        ("success_and_format", Verdict("no_answer"), True, 0.0),
        ("success_and_format", Verdict("error"), True, 0.0),
    ],
)
def test_tables_by_hand(name, verdict, finished, expected):
    parts = get_reward_table(name).compute(
        verdict, num_tokens=10, max_tokens=100, finished=finished
    )
    assert parts.reward == pytest.approx(expected)
    assert parts.success == (verdict.status == "correct")
    assert parts.overlong_penalty == 0.0


@pytest.mark.parametrize(
    "num_tokens, penalty",
    [
        (0, 0.0),
        (75, 0.0),
        (76, 1 / 25),
        (90, 15 / 25),
        (100, 1.0),
        (130, 1.0),
    ],
)
def test_soft_overlong_penalty(num_tokens, penalty):
    # max_tokens=100, buffer = 25 % = 25 tokens: linear from 0 at 75 tokens to 1 at 100.
    table = get_reward_table("soft_overlong")
    parts = table.compute(CORRECT, num_tokens=num_tokens, max_tokens=100, finished=True)
    assert parts.overlong_penalty == pytest.approx(penalty)
    assert parts.reward == pytest.approx(1.0 - penalty)


def test_overlong_overrides_and_errors():
    table = get_reward_table("pure_success", overlong_buffer_tokens=10, overlong_penalty=0.5)
    parts = table.compute(WRONG, num_tokens=96, max_tokens=100, finished=False)
    assert parts.reward == pytest.approx(-0.5 * 6 / 10)
    assert get_reward_table("soft_overlong").buffer(6) == 2  # a tiny task still gets a buffer
    with pytest.raises(ConfigError, match="must be smaller than max_tokens=8"):
        get_reward_table("pure_success", overlong_buffer_tokens=8).buffer(8)
    with pytest.raises(ConfigError, match="not both"):
        get_reward_table("soft_overlong", overlong_buffer_tokens=8)
    with pytest.raises(ConfigError, match="unknown reward table 'sucess'"):
        get_reward_table("sucess")
    with pytest.raises(ConfigError, match="unknown option"):
        get_reward_table("pure_success", buffer=3)


def test_as_verdict():
    assert as_verdict(1.0) == Verdict("correct", 1.0)
    assert as_verdict(True) == Verdict("correct", 1.0)
    assert as_verdict(np.float32(0.25)) == Verdict("wrong", 0.25)
    assert as_verdict(WRONG) is WRONG
    for bad in ("1.0", None, [1.0]):
        with pytest.raises(TypeError, match="return a float"):
            as_verdict(bad)
    with pytest.raises(ValueError, match="not one of"):
        Verdict("maybe")
    # A NaN or infinite score would poison its group's advantages: it is the reward
    # function's error (the pool scores that answer as status "error"), not a score.
    for bad in (float("nan"), float("inf"), np.float32("-inf")):
        with pytest.raises(ValueError, match="return a finite number"):
            as_verdict(bad)
        with pytest.raises(ValueError, match="return a finite number"):
            Verdict("wrong", bad)
    with RewardPool(lambda completion, problem: float("nan"), num_workers=0) as pool:
        got = pool.submit("x", None).result()
    assert got.status == "error" and "return a finite number" in got.detail


def test_resolve_callable():
    assert tables.resolve_callable("os.path:join") is __import__("os").path.join
    assert tables.resolve_callable("pipelinerl_jax.rewards.tables:Verdict.from_score")(1) == CORRECT
    for spec, match in [
        ("os.path.join", "must be 'module.path:callable'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("os.path:nope", "has no attribute 'nope'"),
        ("os:sep", "not callable"),
    ]:
        with pytest.raises(ConfigError, match=match):
            tables.resolve_callable(spec)
    assert tables.reward_fn_spec("math") == "pipelinerl_jax.rewards.math:math_reward"
    assert tables.reward_fn_spec("task") == "pipelinerl_jax.rewards.tables:task_reward"
    assert tables.reward_fn_spec("os.path:join") == "os.path:join"
