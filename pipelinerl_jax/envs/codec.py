"""How an episode's messages become token ids, without ever re-tokenizing what the model said.

The first turn's prompt is the environment's first messages through the tokenizer's chat
template (with the generation prompt). Each later observation is appended to the tokens as
sampled:

* a `user` or `tool` message goes through the chat template's delta: the template renders
  [first messages, the model's turn, the observation] with the generation prompt, and the
  text after the model's turn is tokenized (the end of the model's message, the observation's
  markup, the next assistant header). When the model's turn already ended with that end of
  message (its stop token, e.g. `<|im_end|>`), the delta starts after it;
* a `text` message is raw text appended inside the model's own message (a calculator's
  " = 42" right after the call), tokenized alone.

The model's tokens stay as sampled, so the trained sequence is exactly the one the sampler
decoded. A character tokenizer (the tiny demo tasks: no chat template, no roles) appends the
observation's characters. Observation tokens never start with BOS.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipelinerl_jax.errors import ConfigError

_MARK = "\u2063PIPELINERL_TURN\u2063"  # an invisible separator no template or model writes


class EpisodeCodec:
    """Messages -> token ids for one tokenizer (models.tokenizer.Tokenizer or a CharTokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # A real chat template has roles; the character tokenizers only concatenate contents.
        self.chat = getattr(tokenizer, "chat_template", None) is not None

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        """The first turn's prompt: the messages with the generation prompt."""
        if not self.chat:
            return self.tokenizer.encode("".join(m["content"] for m in messages))
        text = self._render(list(messages), add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def observation(
        self, messages: Sequence[dict], turn_ids: Sequence[int], observation: dict
    ) -> list[int]:
        """The tokens that follow the model's latest turn (`turn_ids`, as sampled) for the
        environment's `observation`; `messages` are the episode's first messages."""
        content = observation["content"]
        if observation["role"] == "text" or not self.chat:
            return self.tokenizer.encode(content, add_special_tokens=False)
        text = self._render(
            [*messages, {"role": "assistant", "content": _MARK}, observation],
            add_generation_prompt=True,
        )
        at = text.find(_MARK)
        if at < 0:
            raise ConfigError(
                "the chat template dropped the assistant's message; episodes need a template "
                "that renders assistant turns"
            )
        delta = text[at + len(_MARK) :]
        if turn_ids:
            ended = self.tokenizer.decode([turn_ids[-1]], skip_special_tokens=False)
            if ended and delta.startswith(ended):  # the model closed its message itself
                delta = delta[len(ended) :]
        return self.tokenizer.encode(delta, add_special_tokens=False)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except ConfigError:
            raise
        except Exception as e:  # jinja2 errors, e.g. a template without a "tool" role
            roles = sorted({m["role"] for m in messages})
            raise ConfigError(
                f"the chat template cannot render an episode with roles {roles} "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); use "
                "observations of role 'user' or 'text'"
            ) from e
