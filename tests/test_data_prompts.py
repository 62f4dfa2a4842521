"""Prompt construction: the paper's chat prompt, plain templates, and configuration errors."""

import jinja2
import pytest

from pipelinerl_jax.data.prompts import (
    DEFAULT_SYSTEM_PROMPT,
    PromptConfig,
    build_messages,
    build_prompt,
)
from pipelinerl_jax.errors import ConfigError

# A ChatML template like Qwen's, rendered the way Hugging Face renders chat templates.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<turn>{{ m['content'] }}</turn>{% endfor %}{% if add_generation_prompt %}<model>{% endif %}"
)


class JinjaTokenizer:
    """Just the chat-template part of a Hugging Face tokenizer."""

    def __init__(self, template):
        env = jinja2.Environment()

        def raise_exception(msg):
            raise jinja2.TemplateError(msg)

        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(template)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        assert tokenize is False
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_default_is_the_papers_chat_prompt():
    assert DEFAULT_SYSTEM_PROMPT == (
        "Please reason step by step, and put your final answer within \\boxed{}."
    )
    text = build_prompt("What is 2+2?", JinjaTokenizer(CHATML))
    assert text == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer "
        "within \\boxed{}.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_messages_variants():
    assert build_messages("Q", PromptConfig(system_prompt=None)) == [
        {"role": "user", "content": "Q"}
    ]
    merged = build_messages(
        "Q", PromptConfig(system_in_user=True, user_template="Problem: {question}")
    )
    assert merged == [{"role": "user", "content": DEFAULT_SYSTEM_PROMPT + "\n\nProblem: Q"}]


def test_template_without_system_role():
    tok = JinjaTokenizer(NO_SYSTEM)
    with pytest.raises(ConfigError, match="system_in_user=True"):
        build_prompt("Q", tok)
    text = build_prompt("Q", tok, PromptConfig(system_in_user=True))
    assert text == f"<turn>{DEFAULT_SYSTEM_PROMPT}\n\nQ</turn><model>"


def test_few_shot_chat_turns_come_before_the_question():
    shots = (("1+2?", "1 + 2 = 3. The answer is \\boxed{3}."), ("5-4?", "\\boxed{1}"))
    text = build_prompt("7+1?", JinjaTokenizer(CHATML), PromptConfig(few_shot=shots))
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\n1+2?<|im_end|>\n"
        "<|im_start|>assistant\n1 + 2 = 3. The answer is \\boxed{3}.<|im_end|>\n"
        "<|im_start|>user\n5-4?<|im_end|>\n<|im_start|>assistant\n\\boxed{1}<|im_end|>\n"
        "<|im_start|>user\n7+1?<|im_end|>\n<|im_start|>assistant\n"
    )
    # The user template dresses the examples' questions too; system_in_user joins the first.
    cfg = PromptConfig(few_shot=shots[:1], user_template="Q: {question}", system_in_user=True)
    assert build_messages("7+1?", cfg) == [
        {"role": "user", "content": f"{DEFAULT_SYSTEM_PROMPT}\n\nQ: 1+2?"},
        {"role": "assistant", "content": shots[0][1]},
        {"role": "user", "content": "Q: 7+1?"},
    ]


def test_few_shot_plain_blocks():
    cfg = PromptConfig(template="plain", system_prompt="Sys.", few_shot=(("1+2?", "3"),))
    assert build_prompt("7+1?", None, cfg) == "Sys.\n\n1+2?\n3\n\n7+1?"


@pytest.mark.parametrize(
    "few_shot", [("1+2?", "3"), (("1+2?",),), (("1+2?", " "),), (("1+2?", 3),)]
)
def test_bad_few_shot(few_shot):
    with pytest.raises(ConfigError, match="few_shot"):
        PromptConfig(few_shot=few_shot)


def test_plain_templates():
    assert build_prompt("Q", None, PromptConfig(template="plain")) == (
        DEFAULT_SYSTEM_PROMPT + "\n\nQ"
    )
    assert build_prompt("Q", None, PromptConfig(template="plain", system_prompt="")) == "Q"
    cfg = PromptConfig(
        template="plain",
        plain_template="Question: {question}\n{system}\nAnswer:",
        system_prompt="Be brief.",
    )
    assert build_prompt("2+2?", None, cfg) == "Question: 2+2?\nBe brief.\nAnswer:"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"template": "alpaca"}, "unknown prompt template"),
        ({"user_template": "Solve it."}, "exactly the placeholder"),
        ({"user_template": "{question} {answer}"}, "exactly the placeholder"),
        ({"plain_template": "{system}"}, "must use {question}"),
        ({"plain_template": "{question"}, "not a valid format string"),
    ],
)
def test_bad_prompt_configs(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PromptConfig(**kwargs)


def test_chat_needs_a_chat_tokenizer():
    with pytest.raises(ConfigError, match="needs a tokenizer with apply_chat_template"):
        build_prompt("Q", object())


def test_with_the_project_tokenizer():
    import tokenizers

    from pipelinerl_jax.models.tokenizer import Tokenizer

    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok = Tokenizer(backend, chat_template=CHATML, eos_token_ids=[2])
    assert build_prompt("Q?", tok) == build_prompt("Q?", JinjaTokenizer(CHATML))
    with pytest.raises(ConfigError, match="no chat template"):
        build_prompt("Q?", Tokenizer(backend, chat_template=None))
