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
from pipelinerl_jax import evaluate_settings as settings
from pipelinerl_jax.data.prompts import DEFAULT_SYSTEM_PROMPT
from pipelinerl_jax.envs.codec import EpisodeCodec
from pipelinerl_jax.envs.runner import EnvironmentPool
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.export import read_run_config
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.pipeline import eval_lib
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
        settings.task_options(fv)  # one line for bad JSON, before anything loads
    if fv.model_dir and not Path(fv.model_dir).is_dir():
        raise ConfigError(f"--model_dir={fv.model_dir}: model directory does not exist")
    for flag in ("out", "samples_out"):  # before the evaluation, not after it
        if fv[flag].value:
            cli.check_output_file(fv[flag].value, flag, inputs={"dataset": fv.dataset})


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
    problems, task = settings.problems(fv, run_config)
    env_spec = settings.env_spec(fv, run_config)  # a bad name or option: one line, before loading
    reward = fv.reward or (getattr(task, "reward_fn", "task") if task is not None else "math")

    reward_spec = reward_fn_spec(reward)  # one-line error for an unknown callable, early
    if fv.workdir:
        if not RunCheckpointer(fv.workdir, read_only=True).steps():
            raise ConfigError(
                f"{fv.workdir}: no checkpoints (a run saves one every "
                "checkpoint_every steps and at its end)"
            )
    tokenizer = settings.tokenizer(fv, task, run_config)
    prompt_config = settings.prompt_config(fv, task, run_config)

    k = 1 if fv.greedy else fv.k
    gen = settings.generation(fv, run_config)
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
    cfg, graphdef, params, step = settings.model(fv)
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
