"""Episode tokens (envs/codec.py): the first prompt is the chat template's; each observation's
tokens are what the template puts after the model's turn, so prompt + turn + observation +
next turn decodes to the template's rendering of the whole conversation; a model turn that
closed its own message is not closed twice; raw text goes inside the model's message; a
character tokenizer appends characters. Checked against transformers' apply_chat_template on
the byte-level BPE tokenizer test_tokenizer.py trains."""

import pytest
import transformers

from pipelinerl_jax.data.tasks import CharTokenizer
from pipelinerl_jax.envs.codec import EpisodeCodec
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import tokenizer as tok_lib
from tests.test_tokenizer import tok_dir  # noqa: F401 - the fixture

FIRST = [{"role": "user", "content": "What is 12 + 30?"}]
# ChatML as SmolLM2 and Qwen write it: a message in the history renders as the generation
# prompt plus its content (test_tokenizer.py's template indents history messages instead).
CHATML = (
    "{% for message in messages %}{% if message['role'] not in ['system', 'user', "
    "'assistant'] %}{{ raise_exception('bad role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def both(tok_dir):  # noqa: F811 - the fixture imported above
    ours = tok_lib.Tokenizer.from_dir(tok_dir)
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    ours.chat_template = ref.chat_template = CHATML
    return ours, ref


def test_prompt_and_observations_follow_the_template(both):
    ours, ref = both
    codec = EpisodeCodec(ours)
    prompt = codec.prompt(FIRST)
    text = ref.apply_chat_template(FIRST, add_generation_prompt=True, tokenize=False)
    assert prompt == ref(text, add_special_tokens=False)["input_ids"]
    end = ours.token_to_id("<|im_end|>")
    turn = ours.encode("The answer is 42.", add_special_tokens=False)
    feedback = {"role": "user", "content": "Are you sure?"}
    for closed in (True, False):  # the model ended with <|im_end|>, or was cut at its budget
        sampled = turn + [end] if closed else turn
        obs = codec.observation(FIRST, sampled, feedback)
        assert obs[0] != ours.token_to_id("<s>")
        whole = ref.apply_chat_template(
            [*FIRST, {"role": "assistant", "content": "The answer is 42."}, feedback],
            add_generation_prompt=True,
            tokenize=False,
        )
        assert ours.decode(prompt + sampled + obs) == whole
        assert ours.decode(obs).startswith("\n" if closed else "<|im_end|>")


def test_raw_text_goes_inside_the_model_message(both):
    ours, _ = both
    codec = EpisodeCodec(ours)
    turn = ours.encode("so 12 + 30", add_special_tokens=False)
    obs = codec.observation(FIRST, turn, {"role": "text", "content": " = 42"})
    assert obs == ours.encode(" = 42", add_special_tokens=False)


def test_a_template_without_the_role_is_one_line(both):
    ours, _ = both
    with pytest.raises(ConfigError, match="cannot render an episode with roles"):
        EpisodeCodec(ours).observation(FIRST, [5], {"role": "tool", "content": "42"})


def test_character_tokenizers_append_characters():
    tok = CharTokenizer("0123456789+=:<>")
    codec = EpisodeCodec(tok)
    assert codec.prompt([{"role": "user", "content": "0:15="}]) == tok.encode("0:15=")
    obs = codec.observation([], [3, tok.eos_token_id], {"role": "user", "content": "<"})
    assert obs == tok.encode("<", add_special_tokens=False)
