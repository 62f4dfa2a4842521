"""Tokenizer and chat template: same text and ids as transformers' AutoTokenizer.

The tokenizer is a byte-level BPE trained here on a few sentences, with a post-processor that
adds BOS (as Llama's does) and a Qwen-style chat template that uses loops, trimming,
`raise_exception`, `tojson` and the special-token variables.
"""

import json

import jinja2
import pytest
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import tokenizer as tok_lib
from pipelinerl_jax.models.config import ModelConfig

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "What is 12 + 30? The answer is 42.",
    "Ünïcödé text: naïve café, 東京, emoji 🙂 and tabs\tand\nnewlines.",
] * 4
TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}\n"
    "{% for message in messages %}\n"
    "  {% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + message['role']) }}{% endif %}\n"
    "  {{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "  {% if message.meta is defined %}{{ message.meta | tojson }}{% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    "{% if bos_token is defined and false %}{{ bos_token }}{% endif %}"
)
MESSAGES = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [
        {"role": "system", "content": "Please reason step by step."},
        {"role": "user", "content": "naïve café 🙂", "meta": {"k": "<b>&'x", "n": [1, 2]}},
        {"role": "assistant", "content": "The answer is 42."},
        {"role": "user", "content": "and\ttabs\nnewlines", "name": None},
    ],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": {
                    "__type": "AddedToken",
                    "content": "<|im_end|>",
                    "special": True,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "single_word": False,
                },
                "pad_token": "<pad>",
                "chat_template": TEMPLATE,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>")]})
    )
    return path


@pytest.fixture(scope="module")
def both(tok_dir):
    return tok_lib.Tokenizer.from_dir(tok_dir), transformers.AutoTokenizer.from_pretrained(tok_dir)


def test_encode_decode_match_transformers(both):
    ours, ref = both
    assert ours.vocab_size == len(ref)
    for text in CORPUS[:4] + ["unseen wörds 123", "<|im_start|>user\nhi<|im_end|>"]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"]
        assert ids[0] == ours.token_to_id("<s>")
        assert (
            ours.encode(text, add_special_tokens=False)
            == ref(text, add_special_tokens=False)["input_ids"]
        )
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
        assert ours.decode(ids, skip_special_tokens=True) == text.replace(
            "<|im_start|>", ""
        ).replace("<|im_end|>", "")


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(both, messages, add_generation_prompt):
    ours, ref = both
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref_text = ref.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == ref_text
    assert "You are helpful" in text or messages[0]["role"] == "system"
    ids = ours.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    assert ids == ref.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )


def test_template_raise_exception_and_tojson(both):
    ours, ref = both
    bad = [{"role": "robot", "content": "hi"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role robot"):
        ours.apply_chat_template(bad)
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role robot"):
        ref.apply_chat_template(bad, tokenize=False)
    text = ours.apply_chat_template(MESSAGES[1][:2])
    assert '{"k": "<b>&\'x", "n": [1, 2]}' in text  # not HTML-escaped, as in transformers


def test_eos_and_pad(both, tok_dir):
    ours, ref = both
    assert ours.eos_token_ids == (ours.token_to_id("</s>"), ours.token_to_id("<|im_end|>"))
    assert ref.eos_token_id in ours.eos_token_ids
    assert ours.pad_token_id == ref.pad_token_id == ours.token_to_id("<pad>")


def test_pad_falls_back_to_eos(tmp_path, tok_dir):
    (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = tok_lib.Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == (tok.token_to_id("</s>"),)
    assert tok.pad_token_id == tok.token_to_id("</s>")
    with pytest.raises(ConfigError, match="no chat template"):
        tok.apply_chat_template(MESSAGES[0])


def test_chat_template_jinja_file_takes_precedence(tmp_path, tok_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((tok_dir / name).read_text())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    tok = tok_lib.Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template(MESSAGES[0]) == "[What is 12 + 30?]"


def test_missing_tokenizer_and_vocab_too_large(tmp_path, both):
    with pytest.raises(ConfigError, match="tokenizer.json: missing"):
        tok_lib.Tokenizer.from_dir(tmp_path)
    ours, _ = both
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=ours.vocab_size - 1,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=False,
    )
    with pytest.raises(ConfigError, match=r"tokenizer has \d+ token ids but .* embedding has"):
        tok_lib.check_vocab(ours, cfg)
