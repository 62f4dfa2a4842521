"""Procedural tasks: tokenizer, determinism, problem distribution, partial-credit rewards."""

import collections

import pytest

from pipelinerl_jax.data.datasets import PromptStream
from pipelinerl_jax.data.prompts import PromptConfig, build_prompt
from pipelinerl_jax.data.tasks import CharTokenizer, make_task
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.tables import get_reward_table, partial_credit, task_reward


def test_tokenizer_round_trip_and_vocab():
    tok = CharTokenizer()
    assert tok.vocab_size == len(tok) == tok.max_token_id + 1 == 16
    assert tok.eos_token_ids == (tok.eos_token_id,) == (tok.token_to_id("<eos>"),)
    assert tok.token_to_id("=") == 14 and tok.token_to_id("x") is None
    ids = tok.encode("120=")
    assert ids == [tok.bos_token_id, 4, 5, 3, 14]
    assert tok.decode(ids) == "<bos>120="
    assert tok.decode(ids, skip_special_tokens=True) == "120="
    assert tok.decode([7, 8, tok.eos_token_id], skip_special_tokens=True) == "45"
    assert tok.encode("9+0:", add_special_tokens=False) == [12, 13, 3, 15]
    with pytest.raises(ValueError, match="character 'x'"):
        tok.encode("12x")
    with pytest.raises(ValueError, match="token id 16"):
        tok.decode([16])


@pytest.mark.parametrize(
    "completion, answer, credit",
    [
        ("54321", "54321", 1.0),
        ("5432", "54321", 4 / 5),  # one position missing
        ("543210", "54321", 5 / 6),  # one extra position
        ("12345", "54321", 1 / 5),  # only the middle digit agrees
        ("", "54321", 0.0),
        ("9", "1", 0.0),
        ("1", "1", 1.0),
        ("15", "51", 0.0),
    ],
)
def test_partial_credit_by_hand(completion, answer, credit):
    assert partial_credit(completion, answer) == pytest.approx(credit)


def test_reverse_digits_problems_are_deterministic_and_well_formed():
    task = make_task("reverse_digits", seed=3)
    same = make_task("reverse_digits", seed=3)
    other = make_task("reverse_digits", seed=4)
    problems = [task.problem(i) for i in range(2000)]
    assert problems == [same.problem(i) for i in range(2000)]
    assert [p.question for p in problems[:50]] != [other.problem(i).question for i in range(50)]
    lengths = collections.Counter()
    for p in problems:
        digits, sep = p.question[:-1], p.question[-1]
        assert sep == "=" and digits.isdigit() and p.answer == digits[::-1]
        lengths[len(digits)] += 1
    assert sorted(lengths) == [1, 2, 3, 4, 5]
    assert min(lengths.values()) > 300  # about uniform over the 5 lengths (400 each)
    assert task.max_prompt_tokens == 7 and task.max_answer_tokens == 6
    assert problems[17].uid == "reverse_digits/17" and problems[17].source == "reverse_digits"


def test_copy_and_add_tasks():
    copy = make_task("copy_digits", max_digits=3)
    add = make_task("add_numbers", seed=1)
    for i in range(200):
        p = copy.problem(i)
        assert p.question == p.answer + ":" and 1 <= len(p.answer) <= 3
        q = add.problem(i)
        a, b = q.question[:-1].split("+")
        assert q.question.endswith("=") and int(q.answer) == int(a) + int(b)
        assert a[0] != "0" and b[0] != "0" and len(a) <= 3
        assert len(add.tokenizer.encode(q.question)) <= add.max_prompt_tokens
        assert len(q.answer) + 1 <= add.max_answer_tokens


def test_task_streams_through_prompt_stream_and_prompt_template():
    task = make_task("reverse_digits", num_problems=64, seed=0)
    stream = PromptStream(task.source(), seed=5)
    epoch = [next(stream) for _ in range(64)]
    assert sorted(p.uid for p in epoch) == sorted(f"reverse_digits/{i}" for i in range(64))
    state = stream.get_state()
    nxt = next(stream)
    again = PromptStream(make_task("reverse_digits", num_problems=64, seed=0).source(), seed=5)
    again.set_state(state)
    assert next(again) == nxt
    with pytest.raises(ConfigError, match="different data"):
        PromptStream(
            make_task("reverse_digits", num_problems=64, seed=1).source(), seed=5
        ).set_state(state)
    # Tasks use the plain template without a system prompt; the chat path gives the same.
    plain = PromptConfig(template="plain", system_prompt=None)
    chat = PromptConfig(template="chat", system_prompt=None)
    p = epoch[0]
    assert build_prompt(p.question, task.tokenizer, plain) == p.question
    assert build_prompt(p.question, task.tokenizer, chat) == p.question
    assert task.tokenizer.apply_chat_template(
        [{"role": "user", "content": p.question}], tokenize=True
    ) == task.tokenizer.encode(p.question)


def test_task_reward_through_the_table():
    task = make_task("reverse_digits")
    p = task.problem(0)
    table = get_reward_table("pure_success")
    exact = task_reward(p.answer, p)
    assert exact.status == "correct" and exact.score == 1.0
    wrong = task_reward("0" * (len(p.answer) + 1), p)
    assert wrong.status == "wrong"
    assert wrong.score == pytest.approx(partial_credit("0" * (len(p.answer) + 1), p.answer))
    assert task_reward("", p).status == "no_answer"
    parts = table.compute(wrong, num_tokens=3, max_tokens=6, finished=True)
    assert parts.reward == pytest.approx(wrong.score) and not parts.success
    assert task.score(p, p.answer) == 1.0


def test_bad_task_configs():
    with pytest.raises(ConfigError, match="unknown task 'sort'"):
        make_task("sort")
    with pytest.raises(ConfigError, match="unknown option"):
        make_task("reverse_digits", digits=4)
    with pytest.raises(ConfigError, match="min_digits"):
        make_task("reverse_digits", min_digits=4, max_digits=2)
    with pytest.raises(ConfigError, match="num_problems"):
        make_task("copy_digits", num_problems=0)
    with pytest.raises(IndexError):
        make_task("copy_digits", num_problems=3).problem(3)
