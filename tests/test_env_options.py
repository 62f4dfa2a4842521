"""Bad environment settings are refused when the config is built, each in one line naming
what is wrong: an option of the wrong type or out of range, a setting that would be ignored
(env.workers without an environment, env.timeout_s without workers) or silently clamped
(env.turn_tokens beyond generation.max_new_tokens), and an environment whose text a
character-level task's vocabulary cannot encode (the run would fail at its first turn)."""

import pytest

from pipelinerl_jax.envs.protocol import Environment, Turn
from pipelinerl_jax.envs.registry import make_env
from pipelinerl_jax.envs.single_turn import SingleTurn
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline.env_spec import EnvSpec
from tests.config_args import run_config

GUESS_WORDS = {"higher": ">", "lower": "<", "again": "=", "base": 16}


def _one_line(e):
    assert "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "name, options, expected",
    [
        ("guess", {"closeness": "abc"}, "guess: option closeness='abc' must be a finite number"),
        ("guess", {"closeness": -1}, "option closeness=-1 must be a finite number >= 0"),
        ("guess", {"consistency": float("nan")}, "option consistency=nan must be a finite"),
        ("guess", {"closeness": True}, "option closeness=True must be a finite number"),
        ("guess", {"role": "bogus"}, "option role='bogus' must be one of ['user', 'tool', 'text']"),
        ("guess", {"role": "tol"}, "did you mean tool?"),
        ("guess", {"higher": 5}, "option higher=5 must be a non-empty string"),
        ("guess", {"again": ""}, "option again='' must be a non-empty string"),
        ("guess", {"higher": "<", "lower": "<"}, "options higher and lower are both '<'"),
        ("guess", {"lo": 10, "hi": 2}, "options lo=10 > hi=2"),
        ("guess", {"lo": -3}, "option lo=-3 must be an int >= 0"),
        ("guess", {"hi": 15.0}, "option hi=15.0 must be an int"),
        ("guess", {"base": "16"}, "option base='16' must be an int >= 2"),
        ("guess", {"base": 40}, "option base=40 must be in [2, 36]"),
        ("guess", {"max_turns": True}, "option max_turns=True must be an int >= 1"),
        ("guess", {"colour": "red"}, "'colour': environment 'guess' has no such option"),
        ("guess", {"hihger": ">"}, "has no such option; did you mean higher?"),
        ("retry", {"discount": "half"}, "retry: option discount='half' must be a finite number"),
        ("retry", {"discount": 2}, "option discount=2 must be a finite number in [0, 1]"),
        ("retry", {"feedback": 0}, "option feedback=0 must be a non-empty string"),
        (
            "retry",
            {"reward_fn": "maths"},
            "reward_fn='maths' must be one of ['math', 'reasoning_gym'",
        ),
        ("retry", {"reward_fn": "maths"}, "did you mean math?"),
        ("single_turn", {"reward_fn": 3}, "single_turn: option reward_fn=3 must be one of"),
        ("calculator", {"example": "no"}, "calculator: option example='no' must be true or false"),
        ("equations", {"example": 0}, "equations: option example=0 must be true or false"),
    ],
)
def test_each_environment_checks_its_options(name, options, expected):
    with pytest.raises(ConfigError, match=None) as e:
        make_env(name, options)
    assert expected in str(e.value)
    _one_line(e)


def test_shipped_defaults_and_good_options_build():
    for name in ("guess", "retry", "calculator", "equations", "single_turn"):
        make_env(name)
    env = make_env("guess", {**GUESS_WORDS, "closeness": 1, "lo": 3, "hi": 3}, max_turns=4)
    assert env.max_turns == 4 and env.closeness == 1.0 and (env.lo, env.hi) == (3, 3)
    assert make_env("guess", {"max_turns": 5}, max_turns=5).max_turns == 5  # both, agreeing


class Picky(Environment):
    """A user's environment that refuses a value with a plain ValueError."""

    def __init__(self, *, level: int = 1, max_turns: int | None = None):
        super().__init__(max_turns=max_turns)
        if level > 3:
            raise ValueError(f"level {level} is too high\nsecond line")

    def first_messages(self, problem):
        return [{"role": "user", "content": problem.question}]

    def respond(self, problem, turns):
        return Turn(None, done=True)


def test_registry_refusals_are_one_line():
    cases = [
        (("gues",), {}, "unknown environment 'gues'", "did you mean guess?"),
        (
            ("guess", {"max_turns": 5}),
            {"max_turns": 3},
            "config.env.max_turns=3 and env.options max_turns=5 disagree",
            "",
        ),
        (
            ("single_turn",),
            {"max_turns": 6},
            "config.env.max_turns=6: environment "
            "'single_turn' takes no max_turns (it plays 1 turn); leave env.max_turns at 0",
            "",
        ),
        (
            (f"{__name__}:Picky", {"level": 5}),
            {},
            "options {'level': 5} refused (ValueError: level 5 is too high)",
            "",
        ),
    ]
    for args, kwargs, expected, hint in cases:
        with pytest.raises(ConfigError) as e:
            make_env(*args, **kwargs)
        assert expected in str(e.value) and hint in str(e.value), str(e.value)
        _one_line(e)
    assert make_env(f"{__name__}:Picky", {"level": 2}, max_turns=2).max_turns == 2


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"workers": 5}, "config.env.workers=5 needs env.name"),
        ({"timeout_s": 30.0}, "config.env.timeout_s=30.0 needs env.name"),
        ({"options": (("lo", 1),)}, "config.env.options={'lo': 1} needs env.name"),
        (
            {"name": "guess", "workers": 0, "timeout_s": 1.0},
            "timeout_s=1.0 applies only with env.workers >= 1",
        ),
        ({"name": "guess", "timeout_s": float("inf")}, "timeout_s=inf finite and > 0"),
        ({"name": "guess", "timeout_s": 0.0}, "timeout_s=0.0 finite and > 0"),
    ],
)
def test_env_spec_refuses_settings_that_would_do_nothing(fields, expected):
    with pytest.raises(ConfigError) as e:
        EnvSpec(**fields)
    assert expected in str(e.value), str(e.value)
    _one_line(e)


def test_env_spec_accepts_its_defaults():
    EnvSpec()
    EnvSpec(name="guess", workers=0)  # no time limit, and none asked for
    EnvSpec(name="guess", workers=1, timeout_s=30.0)


@pytest.mark.parametrize("name", ["guess", "retry", "calculator", "equations"])
def test_a_character_task_refuses_an_environment_it_cannot_encode(name):
    # tiny.py trains reverse_digits: a vocabulary of digits and "+=:".
    with pytest.raises(ConfigError) as e:
        run_config(f"--config.env.name={name}")
    message = str(e.value)
    assert (
        f"config.env.name={name!r} cannot play the character task data.task=reverse_digits"
        in message
    )
    assert "'0123456789+=:'" in message and "train a text task" in message
    _one_line(e)
    if name in ("guess", "retry"):  # words the options set: the message names them
        assert "option " in message and "give env.options words of that vocabulary" in message


def test_a_character_task_plays_an_environment_in_its_vocabulary():
    words = '{"higher": "+", "lower": ":", "again": "="}'
    cfg = run_config("--config.env.name=guess", f"--config.env.options={words}")
    assert cfg.env.name == "guess"
    # The question alone, scored as the task scores it.
    run_config("--config.env.name=single_turn", '--config.env.options={"reward_fn": "task"}')
    run_config(
        "--config.env.name=retry", '--config.env.options={"reward_fn": "task", "feedback": "="}'
    )
    run_config(file="guess.py")


class Chatty(Environment):
    """A user's environment with unknown texts: its first messages are checked."""

    def first_messages(self, problem):
        return [{"role": "user", "content": f"Reverse {problem.question}"}]

    def respond(self, problem, turns):
        return Turn(None, done=True)


class Prompted(SingleTurn):
    """A shipped environment's subclass with its own prompt: its first messages are checked."""

    def first_messages(self, problem):
        return [{"role": "user", "content": f"Q: {problem.question}"}]


@pytest.mark.parametrize("name, chars", [("Chatty", "' Rersv'"), ("Prompted", "' Q'")])
def test_a_user_environments_first_messages_are_checked(name, chars):
    with pytest.raises(ConfigError) as e:
        run_config(f"--config.env.name={__name__}:{name}")
    assert "its first messages '" in str(e.value) and f"has {chars}" in str(e.value)
    _one_line(e)


def test_turn_tokens_beyond_the_episode_budget_are_refused():
    with pytest.raises(ConfigError) as e:
        run_config("--config.env.turn_tokens=12", file="guess.py")
    assert "config.env.turn_tokens=12 exceeds generation.max_new_tokens=11" in str(e.value)
    _one_line(e)
    assert run_config("--config.env.turn_tokens=11", file="guess.py").env.turn_tokens == 11


def test_an_environment_scoring_with_another_reward_than_the_task_is_refused():
    """single_turn / retry score with their own reward_fn (math by default): on reverse_digits,
    scored by its partial credit ("task"), every answer would be unparsable, reward 0."""
    with pytest.raises(ConfigError) as e:
        run_config("--config.env.name=single_turn")
    assert "scores answers with pipelinerl_jax.rewards.math:math_reward" in str(e.value)
    assert "data.task=reverse_digits is scored by 'task'" in str(e.value)
    _one_line(e)
    cfg = run_config("--config.env.name=single_turn", '--config.env.options={"reward_fn": "task"}')
    assert cfg.env.make().reward_spec == "pipelinerl_jax.rewards.tables:task_reward"
    # A text task scored by math-verify takes the default.
    assert run_config("--config.env.name=retry", file="smollm2_math.py").env.name == "retry"


def test_guess_refuses_a_range_other_than_its_tasks():
    """guess_number draws secrets from its lo..hi: the env's own range must be the same, or its
    consistency reward pays for guesses the secrets rule out."""
    with pytest.raises(ConfigError) as e:
        run_config('--config.data.task_options={"lo": 0, "hi": 9}', file="guess.py")
    assert "options lo=0, hi=15 differ from task guess_number's lo=0, hi=9" in str(e.value)
    _one_line(e)
    options = '{"higher": ">", "lower": "<", "again": "=", "base": 16, "lo": 0, "hi": 9}'
    cfg = run_config(
        '--config.data.task_options={"lo": 0, "hi": 9}',
        f"--config.env.options={options}",
        file="guess.py",
    )
    assert cfg.env.make().hi == 9
