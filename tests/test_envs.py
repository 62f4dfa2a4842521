"""Environments (pipelinerl_jax/envs): the protocol's checks, the calculator's safe arithmetic
against exact fractions on random expressions, scripted episodes of the calculator and the
number-guessing environment, a task as a one-turn environment, and environments that hang,
raise or answer garbage in worker processes: each ends its episode with an error or timeout
turn, and the pool keeps serving."""

import random
import time
from fractions import Fraction

import pytest

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.envs import arithmetic, calculator, guess
from pipelinerl_jax.envs.protocol import Environment, Turn, as_turn
from pipelinerl_jax.envs.runner import EnvironmentPool
from pipelinerl_jax.envs.single_turn import SingleTurn
from pipelinerl_jax.errors import ConfigError

PROBLEM = Problem(
    uid="t/0", question="Tom has 12 boxes of 37 pens. How many?", answer="444", source="t"
)


def _random_expression(rng, depth=3):
    if depth == 0 or rng.random() < 0.3:
        return str(rng.randint(0, 99)), Fraction(0)  # placeholder value, recomputed below
    op = rng.choice(["+", "-", "*", "/"])
    left, _ = _random_expression(rng, depth - 1)
    right, _ = _random_expression(rng, depth - 1)
    return f"({left} {op} {right})", Fraction(0)


def _exact(text):
    """The reference value: the same expression over Fractions with Python's own parser."""
    import re

    return eval(re.sub(r"(\d+)", r"Fraction(\1)", text), {"Fraction": Fraction})  # noqa: S307


def test_arithmetic_matches_exact_fractions_on_random_expressions():
    rng = random.Random(11)
    checked = 0
    for _ in range(300):
        text, _ = _random_expression(rng)
        try:
            want = _exact(text)
        except ZeroDivisionError:
            with pytest.raises(arithmetic.ExpressionError, match="division by zero"):
                arithmetic.evaluate(text)
            continue
        if abs(want) > arithmetic.MAX_ABS:
            continue
        assert arithmetic.evaluate(text) == want, text
        checked += 1
    assert checked > 200
    assert arithmetic.show(arithmetic.evaluate("1,200 / 8 ^ 2")) == "18.75"
    assert arithmetic.show(arithmetic.evaluate("-(3 - 10) * 2")) == "14"


@pytest.mark.parametrize(
    "text,why",
    [
        ("__import__('os').system('true')", "Call is not arithmetic"),
        ("x + 1", "Name is not arithmetic"),
        ("(1).real", "Attribute is not arithmetic"),
        ("9 ** 9 ** 9", "powers take whole exponents"),
        ("10 ** 13", "a value beyond"),
        ("2 ** 0.5", "powers take whole exponents"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an expression"),
        ("", "an empty expression"),
        ("1+" * 150 + "1", "longer than"),
        ("{1: 2}", "Dict is not arithmetic"),
        ("1 < 2", "Compare is not arithmetic"),
    ],
)
def test_arithmetic_refuses_what_is_not_plain_arithmetic(text, why):
    with pytest.raises(arithmetic.ExpressionError, match=why):
        arithmetic.evaluate(text)


def test_calculator_episode():
    env = calculator.Calculator()
    assert env.first_messages(PROBLEM)[-1] == {"role": "user", "content": PROBLEM.question}
    turns = ["12 boxes of 37: <calc>12 * 37</calc>"]
    first = env.final(PROBLEM, turns)
    assert first == Turn({"role": "text", "content": " = 444"}, info={"tool_calls": 1})
    turns.append("So the answer is \\boxed{444}.")
    last = env.final(PROBLEM, turns)
    assert last.done and last.reward == 1.0 and last.observation is None
    bad = env.final(PROBLEM, ["<calc>open('f')"])  # the stop string not kept in the text
    assert bad.observation["content"].startswith(" error: Call is not arithmetic")
    assert bad.info == {"tool_calls": 1, "tool_errors": 1} and not bad.done
    wrong = env.final(PROBLEM, ["\\boxed{443}"])
    assert wrong.done and wrong.reward == 0.0
    # The 4th turn is the last whatever it asks for: no observation, the episode ends.
    capped = env.final(PROBLEM, ["<calc>1+1</calc>"] * 4)
    assert capped.done and capped.observation is None


def test_equations_completes_the_models_arithmetic():
    from pipelinerl_jax.envs.equations import Equations, trailing_expression

    assert trailing_expression("so 37 boxes hold 37 * 12 ") == "37 * 12"
    assert trailing_expression("a total of 3 + 5 pens and 2 * (4 - 1) ") == "2 * (4 - 1)"
    assert trailing_expression("line one 3 * 3\nx ") is None  # only the last line counts
    assert trailing_expression("the price ") is None and trailing_expression("42 ") is None
    env = Equations()
    assert env.stop_strings == ("=",) and env.first_messages(PROBLEM)[-1]["content"] == (
        PROBLEM.question
    )
    turns = ["12 boxes of 37 pens hold 12 * 37 ="]
    assert env.final(PROBLEM, turns) == Turn(
        {"role": "text", "content": " 444"}, info={"tool_calls": 1}
    )
    assert env.final(PROBLEM, ["x ="]) == Turn(
        {"role": "text", "content": " "}, info={"no_calls": 1}
    )
    turns.append(" 444 pens. The answer is \\boxed{444}.")
    last = env.final(PROBLEM, turns)
    assert last.done and last.reward == 1.0 and last.info == {"status": "correct"}
    bad = env.final(PROBLEM, ["so 10 / 0 ="])  # not computable: the model goes on
    assert bad == Turn({"role": "text", "content": " "}, info={"no_calls": 1})


def test_guess_binary_search_finds_every_secret_within_5_turns():
    env = guess.GuessNumber()
    lengths = []
    for problem in guess.problems(40, seed=5):
        lo, hi, turns = 0, 15, []
        while True:
            turns.append(f"I guess {(lo + hi) // 2}")
            turn = env.final(problem, turns)
            if turn.done:
                break
            if turn.observation["content"] == "higher":
                lo = (lo + hi) // 2 + 1
            else:
                hi = (lo + hi) // 2 - 1
        assert turn.reward == 1.0 and len(turns) <= 5, (problem.answer, turns)
        lengths.append(len(turns))
    assert sum(lengths) / len(lengths) < 4  # 3.4 on average over 16 secrets
    # The shapings: consistent guesses earn `consistency`, a last miss earns closeness/(1+d).
    shaped = guess.GuessNumber(max_turns=3, consistency=0.1, closeness=0.5, base=16)
    secret = Problem(uid="s", question="", answer="9", source="guess")
    assert shaped.final(secret, ["8"]).reward == pytest.approx(0.1)  # higher: 9..15 open
    assert shaped.final(secret, ["8", "3"]).reward == 0.0  # 3 was ruled out
    assert shaped.final(secret, ["8", "c", "a"]).reward == pytest.approx(0.1 + 0.5 / 2)
    assert shaped.final(secret, ["8", "9"]).reward == pytest.approx(1.1)
    secret = guess.problems(1, seed=1)[0]
    wrong = str((int(secret.answer) + 1) % 16)
    out = env.final(secret, [wrong] * 6)
    assert out.done and out.reward == 0.0  # not found within max_turns
    assert env.final(secret, ["no idea"]).observation == {
        "role": "user",
        "content": "a number, please",
    }


def test_a_task_is_a_one_turn_environment():
    env = SingleTurn("math")
    assert env.final(PROBLEM, ["\\boxed{444}"]) == Turn(None, 1.0, True, info={"status": "correct"})
    assert env.final(PROBLEM, ["no box"]).reward == 0.0


def test_retry_pays_less_for_each_try_and_pickles():
    import pickle

    from pipelinerl_jax.envs.registry import make_env

    env = pickle.loads(pickle.dumps(make_env("retry", {"reward_fn": "math", "discount": 0.5})))
    first = env.final(PROBLEM, ["\\boxed{443}"])
    assert first.observation == {"role": "user", "content": "That is not right. Try again."}
    assert first.info == {"status": "wrong"} and not first.done
    assert env.final(PROBLEM, ["\\boxed{443}", "\\boxed{444}"]).reward == 0.5
    assert env.final(PROBLEM, ["x", "y", "\\boxed{444}"]).reward == 0.25
    last = env.final(PROBLEM, ["x", "y", "z"])  # max_turns=3: the third wrong answer ends it
    assert last.done and last.reward == 0.0 and last.observation is None
    with pytest.raises(ConfigError, match="discount=2"):
        make_env("retry", {"discount": 2})
    with pytest.raises(ConfigError, match="unknown environment 'retr'"):
        make_env("retr")
    with pytest.raises(ConfigError, match="'colour': environment 'guess' has no such option"):
        make_env("guess", {"colour": "red"})
    with pytest.raises(ConfigError, match="returned a list, not a pipelinerl_jax.envs.Environment"):
        make_env("pipelinerl_jax.envs.guess:problems", {"n": 1})


@pytest.mark.parametrize(
    "value,why",
    [
        ({"reward": 1}, "not a Turn"),
        (Turn({"role": "tool", "content": "x"}, reward=float("nan")), "non-finite"),
        (Turn(None, done=False), "no observation"),
        (Turn({"role": "robot", "content": "x"}), "is not"),
        (Turn({"role": "tool", "content": 3}), "is not"),
    ],
)
def test_malformed_turns_are_refused(value, why):
    with pytest.raises((TypeError, ValueError), match=why):
        as_turn(value)


def test_max_turns_is_checked():
    with pytest.raises(ConfigError, match="max_turns=0 must be an int >= 1"):
        guess.GuessNumber(max_turns=0)


class Moody(Environment):
    """Its observation's content says what to do: hang, raise, garbage, or answer."""

    name = "moody"
    max_turns = 3

    def first_messages(self, problem):
        return [{"role": "user", "content": problem.question}]

    def respond(self, problem, turns):
        if turns[-1] == "hang":
            time.sleep(60)
        if turns[-1] == "raise":
            raise RuntimeError("tool crashed")
        if turns[-1] == "garbage":
            return {"observation": "not a turn"}
        return Turn({"role": "tool", "content": turns[-1].upper()})


def test_pool_ends_episodes_of_failing_environments_not_the_run():
    env = Moody()
    with EnvironmentPool(num_workers=1, timeout_s=2.0) as pool:
        futures = {t: pool.submit(env, PROBLEM, [t]) for t in ("hang", "raise", "garbage", "ok")}
        out = {t: f.result(timeout=60) for t, f in futures.items()}
        assert out["hang"].status == "timeout" and out["hang"].done and out["hang"].reward == 0.0
        assert out["raise"].status == "error" and "tool crashed" in out["raise"].info["detail"]
        assert out["garbage"].status == "error" and "not a Turn" in out["garbage"].info["detail"]
        assert out["ok"] == Turn({"role": "tool", "content": "OK"})
        assert pool.respond(env, PROBLEM, ["a", "b", "c"]).done  # max_turns ends it
        assert pool.stats["timeout"] == 1 and pool.stats["error"] == 2
