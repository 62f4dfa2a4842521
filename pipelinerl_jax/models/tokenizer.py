"""Tokenizer and chat template of a Hugging Face model directory, without transformers.

Text <-> ids through the `tokenizers` library (`tokenizer.json`, whose post-processor adds BOS
where the model wants it). The chat template comes from `chat_template.jinja`,
`chat_template.json` or `tokenizer_config.json` (in transformers' order of preference) and is
rendered with a jinja2 environment set up like transformers' (sandboxed, trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a non-escaping `tojson`), with
the named special tokens as variables, so the text and ids equal `apply_chat_template`'s.

Stop tokens: the union of generation_config.json's `eos_token_id` (falling back to config.json)
and the tokenizer's own `eos_token`, since chat models often stop on more than one token.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from pipelinerl_jax.errors import ConfigError

_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None


def _token_content(value: Any) -> str | None:
    """Special tokens are stored as strings or as serialized AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: jinja's own tojson escapes HTML characters.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """A jinja2 template in an environment equivalent to transformers' chat-template one."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _find_chat_template(model_dir: Path, tok_config: dict) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = _read_json(model_dir / "chat_template.json").get("chat_template")
    if template is None:
        template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one.
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


class Tokenizer:
    """Encode/decode, chat template and stop/pad ids of one model directory."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        source: str = "tokenizer",
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.source = source
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        if pad_token_id is None and self.eos_token_ids:
            pad_token_id = self.eos_token_ids[0]
        self.pad_token_id: int = 0 if pad_token_id is None else int(pad_token_id)

    @classmethod
    def from_dir(cls, model_dir) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ConfigError(
                f"{path}: missing; only fast tokenizers (tokenizer.json) are supported, "
                "save one with AutoTokenizer.from_pretrained(...).save_pretrained(dir)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files.
            raise ConfigError(f"{path}: cannot parse tokenizer ({e})") from None
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        special_map = _read_json(model_dir / "special_tokens_map.json")
        special = {}
        for name in _SPECIAL_TOKEN_NAMES:
            content = _token_content(tok_config.get(name)) or _token_content(special_map.get(name))
            if content is not None:
                special[name] = content

        def token_id(name):
            content = special.get(name)
            return None if content is None else backend.token_to_id(content)

        gen_config = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")
        eos = list(
            _as_ids(gen_config.get("eos_token_id")) or _as_ids(model_config.get("eos_token_id"))
        )
        if token_id("eos_token") is not None:
            eos.append(token_id("eos_token"))
        pad = token_id("pad_token")
        if pad is None:
            pad_ids = _as_ids(gen_config.get("pad_token_id")) or _as_ids(
                model_config.get("pad_token_id")
            )
            pad = pad_ids[0] if pad_ids else None
        return cls(
            backend,
            chat_template=_find_chat_template(model_dir, tok_config),
            special_tokens=special,
            eos_token_ids=eos,
            pad_token_id=pad,
            source=str(path),
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_id(self) -> int:
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max(vocab.values()) if vocab else -1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs,
    ) -> str | list[int]:
        """Renders `messages` as transformers' apply_chat_template does; ids when `tokenize`.

        As in transformers, keys whose value is None are dropped from messages, the named special
        tokens are template variables (overridable by `kwargs`), and tokenizing the rendered text
        adds no extra special tokens (the template already contains them).
        """
        if self.chat_template is None:
            raise ConfigError(
                f"{self.source}: the tokenizer has no chat template "
                "(tokenizer_config.json 'chat_template' or chat_template.jinja)"
            )
        if not messages:
            raise ValueError("apply_chat_template: empty conversation")
        messages = [
            _alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages
        ]
        variables = {**self.special_tokens, **kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        text = compile_chat_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    """transformers exposes a message's reasoning under every name templates read it by."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def check_vocab(tokenizer: Tokenizer, cfg) -> None:
    """The tokenizer must not produce ids beyond the embedding table (ids past it read garbage)."""
    n = max(tokenizer.vocab_size, tokenizer.max_token_id + 1)
    if n > cfg.vocab_size:
        raise ConfigError(
            f"{tokenizer.source}: tokenizer has {n} token ids but the model's embedding has "
            f"{cfg.vocab_size} rows (config.json vocab_size); use the tokenizer of this model"
        )
