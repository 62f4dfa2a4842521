"""What an evaluation runs with (evaluate.py): the problems, model, tokenizer, prompt,
sampling and environment, each from its flag, else (with --workdir) from the run's own
config, else the flag's default. One function a setting; evaluate.py checks the flags first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipelinerl_jax.data.datasets import DatasetSpec, load_dataset
from pipelinerl_jax.data.prompts import DEFAULT_SYSTEM_PROMPT, PromptConfig
from pipelinerl_jax.data.tasks import held_out_problems, make_task
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.export import load_model
from pipelinerl_jax.models import hf_io
from pipelinerl_jax.models.tokenizer import Tokenizer
from pipelinerl_jax.pipeline.env_spec import EnvSpec


def task_options(fv) -> dict:
    return json_object(fv, "task_options", '{"difficulty": 1}')


def json_object(fv, name: str, example: str) -> dict:
    value = fv[name].value
    try:
        options = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--{name}={value!r} is not JSON ({e.msg}); give an object such as '{example}'"
        ) from None
    if not isinstance(options, dict):
        raise ConfigError(f"--{name}={value!r} must be a JSON object")
    return options


def env_spec(fv, run_config: dict | None) -> EnvSpec | None:
    """The environment whose episodes are played (--env, else the run's), or None."""
    run_env = (run_config or {}).get("env") or {}
    name = (run_env.get("name") or "") if fv.env is None else fv.env
    if not name:
        if fv.env_options is not None:
            raise ConfigError(
                "--env_options needs an environment: give --env=NAME, or a --workdir of a "
                "run that has one"
            )
        return None
    runs = name == run_env.get("name")  # the run's own: its options and turn limits
    # The run's own workers and timeout, unless the flags say otherwise.
    workers, timeout_s = fv.reward_workers, fv.reward_timeout_s
    if runs and not fv["reward_workers"].present:
        workers = run_env.get("workers", 0)
    if runs and not fv["reward_timeout_s"].present:
        timeout_s = run_env.get("timeout_s", timeout_s)
    options = dict(run_env.get("options") or []) if runs else {}
    if fv.env_options is not None:
        options = json_object(fv, "env_options", '{"max_turns": 4}')
    max_turns = run_env.get("max_turns", 0) if runs and fv.env_options is None else 0
    turn_tokens = run_env.get("turn_tokens", 0) if runs else 0
    return EnvSpec(
        name=name,
        options=tuple(sorted(options.items())),
        max_turns=max_turns if fv.env_max_turns is None else fv.env_max_turns,
        turn_tokens=turn_tokens if fv.env_turn_tokens is None else fv.env_turn_tokens,
        workers=workers,
        timeout_s=timeout_s if workers else EnvSpec().timeout_s,
    )


def problems(fv, run_config: dict | None):
    """(problems, task or None)."""
    if fv.task:
        options = {}
        data = (run_config or {}).get("data") or {}
        if data.get("task") == fv.task:
            options = dict(data.get("task_options") or [])
        if fv.task_options is not None:
            options = task_options(fv)

        task = make_task(fv.task, **options)
        # Never the problems the run trained on: the in-run eval's held-out problems.
        return held_out_problems(fv.task, options, fv.num_problems or 200), task

    loaded = load_dataset(
        DatasetSpec(
            path=fv.dataset,
            format=fv.format,
            question_field=fv.question_field,
            answer_field=fv.answer_field,
        )
    )
    problems = list(loaded.problems)
    if fv.num_problems:
        problems = problems[: fv.num_problems]
    return problems, None


def model(fv):
    """(ModelConfig, graphdef, params, checkpoint step or None)."""
    if fv.model_dir:
        cfg, graphdef, params = hf_io.load_hf(fv.model_dir, param_dtype=fv.dtype)
        return cfg, graphdef, params, None

    step, cfg, graphdef, params = load_model(fv.workdir, fv.step)
    print(f"evaluating checkpoint step {step} of {fv.workdir}", file=sys.stderr)
    return cfg, graphdef, params, step


def tokenizer(fv, task, run_config):
    if task is not None and not task.text_task:
        return task.tokenizer

    candidates = [
        fv.tokenizer_dir,
        fv.model_dir,
        ((run_config or {}).get("model") or {}).get("hf_dir"),
    ]
    for path in candidates:
        if path and (Path(path) / "tokenizer.json").exists():
            return Tokenizer.from_dir(path)
    if fv.tokenizer_dir:
        raise ConfigError(f"--tokenizer_dir={fv.tokenizer_dir}: no tokenizer.json there")
    raise ConfigError(
        "no tokenizer found: the model directory / the run's model.hf_dir has no "
        "tokenizer.json; pass --tokenizer_dir"
    )


def prompt_config(fv, task, run_config):

    if task is not None and not task.text_task:  # the bare question, as in training
        return PromptConfig(template="plain", system_prompt=None)
    if fv.chat is not None:
        template = "chat" if fv.chat else "plain"
    else:
        text = task is not None  # a text task trains with the chat prompt by default
        template = ((run_config or {}).get("data") or {}).get(
            "prompt_template", "chat" if text else "plain"
        )
    # A run's checkpoint is evaluated with the run's own system prompt and examples, unless
    # --system_prompt says otherwise (the flag's default is the paper's prompt).
    data = (run_config or {}).get("data") or {}
    system_prompt = fv.system_prompt
    if run_config is not None and not fv["system_prompt"].present:
        system_prompt = data.get("system_prompt")
        system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
    few_shot = tuple(tuple(pair) for pair in data.get("few_shot") or ()) if fv.few_shot else ()
    return PromptConfig(template=template, system_prompt=system_prompt or None, few_shot=few_shot)


GENERATION_FLAGS = ("temperature", "top_p", "top_k", "max_new_tokens")


def generation(fv, run_config) -> dict:
    """Sampling settings: a flag given on the command line, else the run's (with --workdir),
    else the flag's default."""
    out = {}
    for name in GENERATION_FLAGS:
        value = getattr(fv, name)
        if run_config is not None and not fv[name].present and name in run_config:
            value = run_config[name]
        out[name] = value
    return out
