"""Evaluate a model on a test set: avg@k, pass@k, answer statuses, lengths, as JSON.

    python -m pipelinerl_jax.evaluate --model_dir=HF_DIR --dataset=math500.jsonl --format=math500 \\
        [--k=4 --temperature=1.0 --max_new_tokens=1024 | --greedy] [--chat] [--out=results.json]
    python -m pipelinerl_jax.evaluate --workdir=RUN [--step=N] --dataset=gsm8k_test.jsonl \\
        --format=gsm8k
    python -m pipelinerl_jax.evaluate --workdir=RUN --num_problems=200   # the run's own task

The model is a Hugging Face directory (--model_dir) or a run's checkpoint (--workdir, newest
readable step or --step; its tokenizer comes from the run's model.hf_dir or --tokenizer_dir).
Problems come from dataset files in any supported format (data/formats.py) or from a built-in
procedural task (its own character tokenizer and partial-credit reward; with --workdir and
neither flag, the run's own task and options). Each problem gets k
attempts from the continuous-batching sampler; answers are scored by the reward (default:
math-verify in worker processes with a per-answer timeout; "task" for tasks; or
"module:callable"). A multi-turn run's checkpoint (its config.env), or --env=NAME, plays each
attempt as an episode against the environment, as the run's held-out evaluation does
(--env_max_turns, --env_turn_tokens: the episode's limits, e.g. for an exported run). The
summary (see eval_lib.py) is printed to stdout as JSON and written to --out; --samples_out
writes one JSON line per attempt. Bad input: one line, exit code 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from absl import flags

from pipelinerl_jax import cli
from pipelinerl_jax.data.datasets import DatasetSpec, load_dataset
from pipelinerl_jax.data.prompts import DEFAULT_SYSTEM_PROMPT, PromptConfig
from pipelinerl_jax.data.tasks import held_out_problems, make_task
from pipelinerl_jax.envs.codec import EpisodeCodec
from pipelinerl_jax.envs.runner import EnvironmentPool
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.export import load_model, read_run_config
from pipelinerl_jax.models import hf_io
from pipelinerl_jax.models.tokenizer import Tokenizer
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.pipeline import eval_lib
from pipelinerl_jax.pipeline.env_spec import EnvSpec
from pipelinerl_jax.pipeline.episodes import make_driver
from pipelinerl_jax.rewards.tables import reward_fn_spec
from pipelinerl_jax.rewards.workers import RewardPool
from pipelinerl_jax.sampler import cli_flags
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.sequence import SamplingParams
from pipelinerl_jax.train.checkpoint import RunCheckpointer


def define_flags(fv: flags.FlagValues) -> None:
    def d(define, *args, **kwargs):
        define(*args, flag_values=fv, **kwargs)

    d(flags.DEFINE_string, "model_dir", None, "Hugging Face model directory.")
    d(flags.DEFINE_string, "workdir", None, "Run directory: evaluate its checkpoint instead.")
    d(flags.DEFINE_integer, "step", None, "With --workdir: checkpoint step (default newest).")
    d(
        flags.DEFINE_string,
        "tokenizer_dir",
        None,
        "Tokenizer directory (default: the model's, or the run's model.hf_dir).",
    )
    d(
        flags.DEFINE_string,
        "dataset",
        None,
        "Dataset file, directory or glob (.jsonl/.json/.parquet).",
    )
    d(
        flags.DEFINE_string,
        "format",
        "fields",
        "Record format: gsm8k, math, math500, orz, aime, amc, fields.",
    )
    d(flags.DEFINE_string, "question_field", None, "Dotted path of the question in a record.")
    d(flags.DEFINE_string, "answer_field", None, "Dotted path of the answer in a record.")
    d(flags.DEFINE_string, "task", None, "Built-in procedural task instead of a dataset.")
    d(
        flags.DEFINE_string,
        "task_options",
        None,
        "With --task: its options as a JSON object, "
        "e.g. '{\"difficulty\": 1}' (default: the run's with --workdir, else the task's).",
    )
    d(
        flags.DEFINE_integer,
        "num_problems",
        0,
        "Evaluate the first N problems; 0 = all (tasks: 200).",
    )
    d(flags.DEFINE_integer, "k", 4, "Attempts per problem.")
    d(
        flags.DEFINE_string,
        "env",
        None,
        "Play multi-turn episodes with this environment (a name in envs.ENVIRONMENTS or "
        "module:callable), scored as the run scores them; default: the run's config.env with "
        "--workdir. '' = one answer per attempt.",
    )
    d(
        flags.DEFINE_string,
        "env_options",
        None,
        "The environment's options as a JSON object (default: the run's, for the run's env).",
    )
    d(
        flags.DEFINE_integer,
        "env_max_turns",
        None,
        "Model turns per episode, at most (default: the run's env.max_turns for its env, "
        "else the environment's own).",
    )
    d(
        flags.DEFINE_integer,
        "env_turn_tokens",
        None,
        "Tokens per model turn, at most (default: the run's env.turn_tokens for its env, "
        "else 0: what is left of --max_new_tokens).",
    )
    d(flags.DEFINE_bool, "greedy", False, "Greedy decoding (temperature 0, k = 1).")
    d(flags.DEFINE_float, "temperature", 1.0, "Sampling temperature.")
    d(flags.DEFINE_float, "top_p", 1.0, "Nucleus sampling mass; 1 = off.")
    d(flags.DEFINE_integer, "top_k", 0, "Top-k sampling; 0 = off.")
    d(flags.DEFINE_integer, "max_new_tokens", 512, "Tokens to generate at most per attempt.")
    d(flags.DEFINE_integer, "seed", 0, "Sampling seed.")
    d(
        flags.DEFINE_bool,
        "chat",
        None,
        "Use the chat template (default: the run's template with --workdir, else plain).",
    )
    d(flags.DEFINE_string, "system_prompt", DEFAULT_SYSTEM_PROMPT, "System prompt; '' = none.")
    d(
        flags.DEFINE_bool,
        "few_shot",
        True,
        "With --workdir: show the run's few-shot examples "
        "(data.few_shot) before each question; --nofew_shot asks zero-shot.",
    )
    d(
        flags.DEFINE_string,
        "reward",
        None,
        "Reward: math, task or module:callable (default: task for --task, else math).",
    )
    d(flags.DEFINE_integer, "reward_workers", 2, "Reward worker processes; 0 = inline, no timeout.")
    d(flags.DEFINE_float, "reward_timeout_s", 5.0, "Per-answer reward timeout (seconds).")
    cli_flags.define(fv, num_slots=32)
    d(
        flags.DEFINE_enum,
        "dtype",
        "float32",
        ["float32", "bfloat16"],
        "Param/compute dtype for --model_dir.",
    )
    d(flags.DEFINE_string, "out", None, "Write the summary JSON here too.")
    d(flags.DEFINE_string, "samples_out", None, "Write every attempt as a JSON line here.")
    d(flags.DEFINE_bool, "progress", True, "Show a progress bar on stderr.")


def _check_flags(fv) -> None:
    if bool(fv.model_dir) == bool(fv.workdir):
        raise ConfigError(
            "give exactly one of --model_dir (a Hugging Face directory) or "
            "--workdir (a run's checkpoint)"
        )
    if fv.dataset and fv.task or not (fv.dataset or fv.task or fv.workdir):
        raise ConfigError("give exactly one of --dataset (a file) or --task (a built-in task)")
    for flag in ("env_max_turns", "env_turn_tokens"):
        if fv[flag].value is not None and fv[flag].value < 0:
            raise ConfigError(f"--{flag}={fv[flag].value} must be >= 0 (0: no limit of its own)")
    if fv.k < 1 or fv.k > fv.num_slots:
        raise ConfigError(f"--k={fv.k} must be between 1 and --num_slots={fv.num_slots}")
    if fv.max_new_tokens < 1 or fv.num_problems < 0:
        raise ConfigError("--max_new_tokens must be >= 1 and --num_problems >= 0")
    cli_flags.check(fv)
    if fv.reward_workers < 0 or not 0 < fv.reward_timeout_s < float("inf"):
        raise ConfigError(
            f"--reward_workers={fv.reward_workers} must be >= 0 (0: inline) and "
            f"--reward_timeout_s={fv.reward_timeout_s} finite and > 0"
        )
    if fv.reward_workers == 0 and fv["reward_timeout_s"].present:
        raise ConfigError(
            "--reward_timeout_s applies only with --reward_workers >= 1: 0 scores inline, "
            "with no time limit; set --reward_workers or leave --reward_timeout_s out"
        )
    if fv.task_options is not None:
        _task_options(fv)  # one line for bad JSON, before anything loads
    if fv.model_dir and not Path(fv.model_dir).is_dir():
        raise ConfigError(f"--model_dir={fv.model_dir}: model directory does not exist")
    for flag in ("out", "samples_out"):  # before the evaluation, not after it
        if fv[flag].value:
            cli.check_output_file(fv[flag].value, flag, inputs={"dataset": fv.dataset})


def _task_options(fv) -> dict:
    return _json_object(fv, "task_options", '{"difficulty": 1}')


def _json_object(fv, name: str, example: str) -> dict:
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


def _env_spec(fv, run_config: dict | None) -> EnvSpec | None:
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
        options = _json_object(fv, "env_options", '{"max_turns": 4}')
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


def _problems(fv, run_config: dict | None):
    """(problems, task or None)."""
    if fv.task:
        options = {}
        data = (run_config or {}).get("data") or {}
        if data.get("task") == fv.task:
            options = dict(data.get("task_options") or [])
        if fv.task_options is not None:
            options = _task_options(fv)

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


def _model(fv):
    """(ModelConfig, graphdef, params, checkpoint step or None)."""
    if fv.model_dir:
        cfg, graphdef, params = hf_io.load_hf(fv.model_dir, param_dtype=fv.dtype)
        return cfg, graphdef, params, None

    step, cfg, graphdef, params = load_model(fv.workdir, fv.step)
    print(f"evaluating checkpoint step {step} of {fv.workdir}", file=sys.stderr)
    return cfg, graphdef, params, step


def _tokenizer(fv, task, run_config):
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


def _prompt_config(fv, task, run_config):

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


def _generation(fv, run_config) -> dict:
    """Sampling settings: a flag given on the command line, else the run's (with --workdir),
    else the flag's default."""
    out = {}
    for name in GENERATION_FLAGS:
        value = getattr(fv, name)
        if run_config is not None and not fv[name].present and name in run_config:
            value = run_config[name]
        out[name] = value
    return out


def evaluate_cli(fv) -> dict:
    """Runs the whole evaluation; returns the results. Raises ConfigError on bad input."""
    _check_flags(fv)
    run_config = None
    if fv.workdir:
        if not Path(fv.workdir).is_dir():
            raise ConfigError(f"--workdir={fv.workdir}: directory does not exist")
        run_config = read_run_config(fv.workdir)
        if not fv.dataset and not fv.task:  # the run's own task
            fv.task = ((run_config or {}).get("data") or {}).get("task") or None
            if not fv.task:
                raise ConfigError(
                    f"give --dataset or --task: the run in {fv.workdir} trains on files "
                    "(data.datasets), not a task; its held-out files are its eval.datasets"
                )
    problems, task = _problems(fv, run_config)
    env_spec = _env_spec(fv, run_config)  # a bad name or option: one line, before loading
    reward = fv.reward or (getattr(task, "reward_fn", "task") if task is not None else "math")

    reward_spec = reward_fn_spec(reward)  # one-line error for an unknown callable, early
    if fv.workdir:
        if not RunCheckpointer(fv.workdir, read_only=True).steps():
            raise ConfigError(
                f"{fv.workdir}: no checkpoints (a run saves one every "
                "checkpoint_every steps and at its end)"
            )
    tokenizer = _tokenizer(fv, task, run_config)
    prompt_config = _prompt_config(fv, task, run_config)

    k = 1 if fv.greedy else fv.k
    gen = _generation(fv, run_config)
    sampling = SamplingParams(
        temperature=0.0 if fv.greedy else gen["temperature"],
        top_p=gen["top_p"],
        top_k=gen["top_k"],
        max_new_tokens=gen["max_new_tokens"],
    )
    if sampling.error():
        raise ConfigError(f"sampling flags: {sampling.error()}")
    longest = 1
    env = env_spec.make() if env_spec is not None else None
    codec = EpisodeCodec(tokenizer) if env is not None else None
    for p in problems:
        try:
            if env is not None:  # an episode's first prompt: the environment's messages
                ids = codec.prompt(env.first_messages(p))
            else:
                ids = eval_lib.encode_problem(p, tokenizer, prompt_config)
            longest = max(longest, len(ids))
        except ConfigError:
            raise
        except Exception:
            pass  # the problem's error is reported per problem by evaluate_problems
    cfg, graphdef, params, step = _model(fv)
    sampler = PagedSampler(
        graphdef,
        params,
        cli_flags.sampler_config(
            fv,
            longest_prompt=longest,
            max_new_tokens=sampling.max_new_tokens,
            model_limit=cfg.max_position_embeddings,
        ),
        eos_token_ids=getattr(tokenizer, "eos_token_ids", ()),
        # The text an environment's stop strings match (a tool call's end): without it every
        # episode of calculator, equations or python was an error.
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )
    del params

    bar = None
    if fv.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(problems) * k, desc="attempts", unit="sample", file=sys.stderr)

    if env_spec is not None:
        with EnvironmentPool(
            num_workers=env_spec.workers, timeout_s=env_spec.timeout_s
        ) as env_pool:
            driver = make_driver(
                env_spec, tokenizer, env_pool, max_new_tokens=sampling.max_new_tokens
            )
            results = eval_lib.evaluate_episodes(
                sampler, driver, problems, k, sampling, return_samples=True
            )
        if bar is not None:
            bar.update(len(problems) * k)
    else:
        with RewardPool(
            reward_spec, num_workers=fv.reward_workers, timeout_s=fv.reward_timeout_s
        ) as pool:
            results = eval_lib.evaluate_problems(
                sampler,
                tokenizer,
                problems,
                pool,
                k,
                sampling,
                prompt_config,
                return_samples=True,  # the first error's message, said below
                progress=bar.update if bar else None,
            )
    if bar is not None:
        bar.close()
    samples = results.pop("samples", None)
    results["config"] = {
        "model": fv.model_dir or fv.workdir,
        "step": step,
        "dataset": fv.dataset or fv.task,
        "format": None if task is not None else fv.format,
        "k": k,
        "greedy": fv.greedy,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens,
        "template": prompt_config.template,
        "reward": reward if env_spec is None else f"env {env_spec.name}",
        "env": None if env_spec is None else config_lib.as_dict(env_spec),
        "seed": fv.seed,
    }
    if fv.samples_out:
        _write_atomic(
            fv.samples_out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in samples)
        )
    if fv.out:
        _write_atomic(fv.out, json.dumps(results, indent=2) + "\n")
    _say_errors(samples)
    return results


def _say_errors(samples: list[dict]) -> None:
    """One stderr line when attempts ended in an error (the summary only counts them)."""
    failed = [r for r in samples if r.get("status") == "error"]
    if failed:
        first = str(failed[0].get("error") or "no message").splitlines()[0][:300]
        print(
            f"evaluate: {len(failed)} of {len(samples)} attempts ended in an error; the "
            f"first: {first}",
            file=sys.stderr,
        )


def _write_atomic(path: str, text: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)


def run_cli(argv: list[str]) -> int:
    """Parses argv (argv[0] is the program name) with fresh flags; returns the exit code."""
    return cli.run(argv, define_flags, _cli_body)


def _cli_body(fv: flags.FlagValues) -> int:
    """Prints the summary; exit code 1 when every attempt ended in an error (nothing was
    evaluated: a broken reward function, environment or model)."""
    results = evaluate_cli(fv)
    print(json.dumps(results, indent=2))
    return (
        1 if results["num_samples"] and results["status"]["error"] == results["num_samples"] else 0
    )


def main() -> None:
    sys.exit(run_cli(sys.argv))


if __name__ == "__main__":
    main()
