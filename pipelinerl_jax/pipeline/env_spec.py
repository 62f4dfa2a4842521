"""EnvSpec: the run config's env section, the environment multi-turn episodes are played
against, and how it fits the rest of the run (budget, a character task's vocabulary, the
task's scorer). pipeline/config.py's RunConfig holds one and calls `check_fits`."""

from __future__ import annotations

import dataclasses

from pipelinerl_jax.data.tasks import TASKS, make_task
from pipelinerl_jax.envs.protocol import Environment
from pipelinerl_jax.envs.registry import make_env
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.tables import BUILTIN_REWARDS

# What a turn takes beyond an environment's own limit: starting its child process, the pool's
# round trip.
_START_S = 1.0


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """Multi-turn episodes: the environment that answers each model turn (pipeline/episodes.py).
    Without one, every attempt is one answer scored by the reward section."""

    name: str = ""  # "": one answer per attempt; a name in envs.ENVIRONMENTS (calculator,
    #   equations, guess, python, retry, single_turn) or "module.path:callable" returning an
    #   Environment
    options: tuple = ()  # a dict of the environment's keyword arguments
    max_turns: int = 0  # model turns per episode, at most (0: the environment's own)
    turn_tokens: int = 0  # tokens per model turn, at most (0: what is left of
    #   generation.max_new_tokens, which bounds the whole episode after its prompt)
    workers: int = 2  # processes answering turns (0: in the sampler thread, no time limit)
    timeout_s: float = 5.0  # seconds per turn before it counts as a timeout (ends the episode)

    def __post_init__(self):
        if min(self.max_turns, self.turn_tokens, self.workers) < 0 or not (
            0 < self.timeout_s < float("inf")
        ):
            raise ConfigError(
                f"config.env: max_turns={self.max_turns}, turn_tokens={self.turn_tokens} and "
                f"workers={self.workers} must be >= 0 and timeout_s={self.timeout_s} finite "
                "and > 0"
            )
        default = EnvSpec.__dataclass_fields__
        timeout_set = self.timeout_s != default["timeout_s"].default
        if self.name:
            self.make()  # a bad name or option fails here, in one line
        else:
            changed = [f"env.options={dict(self.options)}"] if self.options else []
            changed += [
                f"env.{f}={getattr(self, f)!r}"
                for f in ("max_turns", "turn_tokens", "workers", "timeout_s")
                if getattr(self, f) != default[f].default
            ]
            if changed:
                raise ConfigError(
                    f"config.{changed[0]} needs env.name (an environment); without one it "
                    "applies to nothing (one-answer runs score with reward.workers and "
                    "reward.timeout_s): set env.name or leave it out"
                )
        if self.workers == 0 and timeout_set:
            raise ConfigError(
                f"config.env.timeout_s={self.timeout_s} applies only with env.workers >= 1: "
                "env.workers=0 answers turns in the sampler thread, with no time limit; set "
                "env.workers or leave timeout_s out"
            )

    def make(self):
        """The environment (envs.protocol.Environment), or None without one."""
        if not self.name:
            return None
        return make_env(self.name, dict(self.options), max_turns=self.max_turns)

    def check_fits(self, data, max_new_tokens: int) -> None:
        """The run's other sections (RunConfig.check_sections_fit): turns fit the episode's
        budget, a character-level task's vocabulary holds what the environment writes, and an
        environment scoring with a reward function uses the task's. `data`: the run's DataSpec."""
        if not self.name:
            return
        if self.turn_tokens > max_new_tokens:
            raise ConfigError(
                f"config.env.turn_tokens={self.turn_tokens} exceeds generation.max_new_tokens="
                f"{max_new_tokens}, which bounds the whole episode after its prompt; lower "
                "env.turn_tokens (0: what is left of the episode) or raise max_new_tokens"
            )
        env = self.make()
        own = getattr(env, "turn_seconds", None)  # a turn's own time limit (python's)
        if own is not None and self.workers and own + _START_S > self.timeout_s:
            raise ConfigError(
                f"config.env.name={self.name!r} gives a turn {own:g} s of its own (option "
                f"timeout_s), which env.timeout_s={self.timeout_s:g} cuts short (the worker "
                f"is ended and the episode with it): raise env.timeout_s to at least "
                f"{own + _START_S:g} or lower the option"
            )
        if data.task and type(env).check_task is not Environment.check_task:
            env.check_task(make_task(data.task, **dict(data.task_options)))
        if data.task and not TASKS[data.task].text_task:
            self._check_vocabulary(env, data)
        scorer = getattr(env, "reward_spec", None)  # single_turn, retry: a reward function
        wanted = getattr(TASKS.get(data.task), "reward_fn", "task") if data.task else None
        if scorer and wanted and scorer != BUILTIN_REWARDS.get(wanted, wanted):
            # e.g. retry's default math-verify on reverse_digits: every answer unparsable.
            raise ConfigError(
                f"config.env.name={self.name!r} scores answers with {scorer}, but "
                f"data.task={data.task} is scored by {wanted!r}: add "
                f'"reward_fn": "{wanted}" to --config.env.options'
            )

    def _check_vocabulary(self, env, data) -> None:
        """A character task's tokenizer encodes what `env` writes (else its first turn fails)."""
        task = TASKS[data.task](**dict(data.task_options))  # a DigitTask
        vocab = task.tokenizer

        def unknown(texts: dict) -> dict:
            out = {}
            for what, text in texts.items():
                chars = "".join(sorted({ch for ch in text if vocab.token_to_id(ch) is None}))
                if chars:
                    out[what] = f"{what} {text[:30]!r} has {chars[:12]!r}"
            return out

        # What it says it writes, then (a subclass may prompt otherwise) its first messages.
        bad = unknown(env.texts() or {})
        if not bad:
            try:
                first = env.first_messages(task.problem(0))
            except Exception as e:  # noqa: BLE001 - a user's environment: said in one line
                raise ConfigError(
                    f"config.env.name={self.name!r}: first_messages() of a {data.task} problem "
                    f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                ) from None
            text = "".join(str(m.get("content", "")) for m in first)
            bad = unknown({"its first messages": text})
        if bad:
            allowed = "".join(t for t in vocab.tokens if len(t) == 1)
            fix = (
                "give env.options words of that vocabulary (configs/guess.py does) or "
                if all(what.startswith("option ") for what in bad)
                else ""
            )
            raise ConfigError(
                f"config.env.name={self.name!r} cannot play the character task data.task="
                f"{data.task}, whose vocabulary is {allowed!r}: {'; '.join(bad.values())}; "
                f"{fix}train a text task (data.task=word_problems or data.datasets, with "
                "model.hf_dir)"
            )
