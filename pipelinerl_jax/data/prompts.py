"""Prompt construction: a problem's question -> the text the sampler continues.

Two templates. `chat` (the paper's): a system message, by default "Please reason step by
step, and put your final answer within \\boxed{}.", the question as the user message, rendered
by the tokenizer's own chat template with the generation prompt appended. `plain`: a format
string over {system} and {question}, for base models without a chat template and for the tiny
task models (whose tokenizer has no roles).

Few-shot examples (`few_shot`: (question, answer) pairs) go before the question: as earlier
user / assistant turns in `chat`, as "question, newline, answer, blank line" blocks in
`plain`. A small instruct model follows a shown answer format far more often than a described
one (docs/real_model.md).

The tokenizer is anything with `apply_chat_template(messages, add_generation_prompt=True,
tokenize=False)`: a Hugging Face tokenizer, models/tokenizer.py, or tasks.CharTokenizer.

The prompt stream a run draws from (`pipeline.run(cfg, prompts=...)`) is any iterable of
`data.formats.Problem`s: a list, a generator, or `data.datasets.PromptStream` (grain: shuffled,
repeated, sharded), which is what a run builds from its config. A stream that also has
`get_state()` / `set_state(state)` (`CheckpointableStream`) is saved with each checkpoint and
repositioned on resume; a checkpoint of a run whose stream has neither holds everything else,
and resuming from it is refused (`not_resumable`), since no one knows where the stream stood.
"""

import dataclasses
import string
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from pipelinerl_jax.errors import ConfigError

DEFAULT_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = ("chat", "plain")


def _placeholders(fmt: str, what: str) -> set[str]:
    try:
        return {name for _, name, _, _ in string.Formatter().parse(fmt) if name is not None}
    except ValueError as e:
        raise ConfigError(
            f"prompt {what} {fmt!r} is not a valid format string ({e}); "
            "write literal braces as {{ and }}"
        ) from None


@dataclasses.dataclass(frozen=True)
class PromptConfig:
    """How a question becomes a prompt."""

    template: str = "chat"  # "chat" or "plain"
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT  # None or "": no system message
    user_template: str = "{question}"  # the user message; {question} is the problem
    plain_template: str | None = None  # plain only; default: system, blank line, question
    system_in_user: bool = False  # chat only: for templates without a system role
    few_shot: tuple = ()  # ((question, answer), ...) shown before the question

    def __post_init__(self):
        for i, pair in enumerate(self.few_shot):
            if (
                not isinstance(pair, (tuple, list))
                or len(pair) != 2
                or not all(isinstance(x, str) and x.strip() for x in pair)
            ):
                raise ConfigError(
                    f"prompt few_shot[{i}] must be a (question, answer) pair of "
                    f"non-empty strings, got {pair!r}"
                )
        if self.template not in TEMPLATES:
            raise ConfigError(f"unknown prompt template {self.template!r}; use one of {TEMPLATES}")
        names = _placeholders(self.user_template, "user_template")
        if names != {"question"}:
            raise ConfigError(
                f"prompt user_template {self.user_template!r} must use exactly "
                f"the placeholder {{question}} (found {sorted(names)})"
            )
        if self.plain_template is not None:
            names = _placeholders(self.plain_template, "plain_template")
            if "question" not in names or not names <= {"question", "system"}:
                raise ConfigError(
                    f"prompt plain_template {self.plain_template!r} must use "
                    f"{{question}} and may use {{system}} (found {sorted(names)})"
                )


def build_messages(question: str, config: PromptConfig = PromptConfig()) -> list[dict]:
    """Chat messages for one question: [system,] (user, assistant) per example, user."""
    turns = []
    for q, a in config.few_shot:
        turns += [
            {"role": "user", "content": config.user_template.format(question=q)},
            {"role": "assistant", "content": a},
        ]
    turns.append({"role": "user", "content": config.user_template.format(question=question)})
    if not config.system_prompt:
        return turns
    if config.system_in_user:
        first = turns[0]["content"]
        return [{"role": "user", "content": f"{config.system_prompt}\n\n{first}"}] + turns[1:]
    return [{"role": "system", "content": config.system_prompt}] + turns


def build_prompt(question: str, tokenizer=None, config: PromptConfig = PromptConfig()) -> str:
    """The prompt text for one question (tokenize it with the same tokenizer afterwards)."""
    if config.template == "plain":
        system = config.system_prompt or ""
        shots = "".join(
            f"{config.user_template.format(question=q)}\n{a}\n\n" for q, a in config.few_shot
        )
        if config.plain_template is not None:
            return config.plain_template.format(system=system, question=shots + question)
        user = shots + config.user_template.format(question=question)
        return f"{system}\n\n{user}" if system else user
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise ConfigError(
            "prompt template 'chat' needs a tokenizer with apply_chat_template; "
            "use template='plain' for tokenizers without a chat template"
        )
    try:
        text = tokenizer.apply_chat_template(
            build_messages(question, config), add_generation_prompt=True, tokenize=False
        )
    except ConfigError:
        raise
    except Exception as e:  # HF raises ValueError (no template) or jinja2 errors (no system role)
        raise ConfigError(
            f"the tokenizer's chat template failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); set "
            "system_in_user=True if it has no system role, or "
            "template='plain'"
        ) from e
    if not isinstance(text, str):
        raise ConfigError(
            f"tokenizer.apply_chat_template(..., tokenize=False) returned "
            f"{type(text).__name__}, expected str"
        )
    return text


@runtime_checkable
class CheckpointableStream(Protocol):
    """A prompt stream whose position a checkpoint can save and a resume can restore."""

    def __next__(self) -> Any:
        """The next problem (a data.formats.Problem)."""
        ...

    def get_state(self) -> Any:
        """The stream's position, JSON-able (saved in the checkpoint's extra)."""
        ...

    def set_state(self, state: Any) -> None:
        """Moves the stream to a position get_state() returned, before the first draw."""
        ...


def as_stream(prompts: Iterable) -> Iterator:
    """The iterator a run draws prompts from: `prompts` itself when it is one (a generator, a
    PromptStream: its position and state are the stream's), else iter(prompts)."""
    if isinstance(prompts, Iterator):
        return prompts
    try:
        return iter(prompts)
    except TypeError:
        raise ConfigError(
            f"prompts: {type(prompts).__name__} is not iterable; pass an iterable of "
            "data.formats.Problem (a list, a generator, data.datasets.PromptStream)"
        ) from None


def resumable(stream) -> bool:
    """Whether `stream` can save and restore its position (CheckpointableStream)."""
    return isinstance(stream, CheckpointableStream)


def not_resumable(stream, step: int) -> ConfigError:
    """The one-line refusal to resume from the checkpoint at `step` with `stream`."""
    return ConfigError(
        f"cannot resume from the checkpoint at step {step}: the prompt stream "
        f"({type(stream).__name__}) has no get_state/set_state, so it cannot be put back where "
        "the run left it; pass a stream with both (a grain iterator, e.g. "
        "pipelinerl_jax.data.datasets.PromptStream), or start in a fresh workdir"
    )


def no_saved_position(step: int) -> ConfigError:
    """The one-line refusal to resume from a checkpoint that holds no stream position."""
    return ConfigError(
        f"cannot resume from the checkpoint at step {step}: its run drew prompts from a "
        "stream without get_state/set_state, so the checkpoint holds no stream position; "
        "start in a fresh workdir (a run that should resume needs a stream with both, e.g. "
        "pipelinerl_jax.data.datasets.PromptStream)"
    )
