"""How often does the starting model answer in \\boxed{}? Prompt variants on the real model.

    make real-model                                 # once
    python bench/real_prompts.py                    # 32 held-out problems x 4 attempts each
    python bench/real_prompts.py --problems=8 --variants=paper,one_shot --temperatures=0.8

An RL step learns only from groups whose attempts differ in reward: with a success reward on
the last \\boxed{} answer, a prompt under which the model never boxes gives no gradient at all.
This samples SmolLM2-135M-Instruct on held-out `word_problems` (difficulty 1) under each prompt
variant and temperature, and reports per variant: boxed rate (a parsed \\boxed{} answer, right
or wrong), accuracy (math-verify on the boxed answer), the rate of the model's own final-answer
forms ("The answer is N", "#### N"), the share of groups with differing boxed outcomes, the
prompt length and the median answer length. The one-shot variant is configs/smollm2_math.py's
prompt. Writes bench/results/real_prompts.json.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

MODEL_DIR = common.REAL_MODEL_DIR
# The model's own final-answer forms, which a boxed-answer reward does not read.
PLAIN_ANSWER = re.compile(r"(?:answer is|####)\s*:?\s*\$?(-?[\d,]+(?:\.\d+)?)")


def variants() -> dict:
    """name -> PromptConfig: the paper's, two described formats, and the real config's."""
    from configs import smollm2_math
    from pipelinerl_jax.data.prompts import PromptConfig
    from pipelinerl_jax.pipeline.components import prompt_config
    from pipelinerl_jax.pipeline.config_dict import from_config_dict

    described = (
        "Solve the math problem step by step. At the end, write the final answer as a "
        "number inside \\boxed{}, for example: The answer is \\boxed{42}."
    )
    return {
        "paper": PromptConfig(),
        "described_in_system": PromptConfig(system_prompt=described),
        "asked_in_user": PromptConfig(
            user_template="{question}\nPut your final answer within \\boxed{{}}."
        ),
        "one_shot": prompt_config(from_config_dict(smollm2_math.get_config()).data),
    }


def score(samples: list[dict], k: int) -> dict:
    """Rates over eval_lib samples (k consecutive attempts per problem)."""
    boxed = [s["status"] in ("correct", "wrong") for s in samples]
    plain = [PLAIN_ANSWER.findall(s["completion"]) for s in samples]
    groups = [boxed[i : i + k] for i in range(0, len(boxed), k)]
    n = len(samples)
    return {
        "attempts": n,
        "boxed_rate": sum(boxed) / n,
        "accuracy": sum(s["status"] == "correct" for s in samples) / n,
        "plain_form_rate": sum(bool(m) for m in plain) / n,
        "plain_form_correct": sum(
            bool(m) and m[-1].replace(",", "") == s["answer"] for m, s in zip(plain, samples)
        )
        / n,
        "groups_with_differing_boxed": sum(any(g) and not all(g) for g in groups) / len(groups),
        "stopped_rate": sum(s["finish_reason"] == "stop" for s in samples) / n,
        "median_answer_tokens": statistics.median(s["num_tokens"] for s in samples),
    }


def main() -> None:
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problems", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--temperatures", default="0.8,1.0")
    p.add_argument("--variants", default="paper,described_in_system,asked_in_user,one_shot")
    p.add_argument("--max_new_tokens", type=int, default=192)
    args = p.parse_args()
    for flag in ("problems", "k", "max_new_tokens"):
        common.at_least(getattr(args, flag), f"--{flag}")
    temperatures = common.number_list(
        args.temperatures, "--temperatures", kind=float, minimum=0, example="0.8,1.0"
    )
    common.require_model(MODEL_DIR)
    all_variants = variants()
    names = common.names_list(args.variants, "--variants", list(all_variants))
    from pipelinerl_jax.pipeline.compile_watch import enable_persistent_cache

    enable_persistent_cache("auto")
    from pipelinerl_jax.data.tasks import held_out_problems
    from pipelinerl_jax.models import hf_io
    from pipelinerl_jax.models.tokenizer import Tokenizer
    from pipelinerl_jax.pipeline import eval_lib
    from pipelinerl_jax.rewards.math import math_reward
    from pipelinerl_jax.sampler.config import SamplerConfig
    from pipelinerl_jax.sampler.sampler import PagedSampler
    from pipelinerl_jax.sampler.sequence import SamplingParams

    load = common.warn_if_busy()
    tokenizer = Tokenizer.from_dir(MODEL_DIR)
    _, graphdef, params = hf_io.load_hf(MODEL_DIR)
    problems = held_out_problems("word_problems", {"difficulty": 1}, args.problems)
    sampler = PagedSampler(
        graphdef,
        params,
        SamplerConfig(
            num_slots=32, max_seq_len=384, page_size=16, chunk_steps=16, prefill_chunk=384, seed=0
        ),
        eos_token_ids=tokenizer.eos_token_ids,
    )
    rows = []
    for temperature in temperatures:
        sampling = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens)
        for name in names:
            prompt = all_variants[name]
            t0 = time.perf_counter()
            res = eval_lib.evaluate_problems(
                sampler,
                tokenizer,
                problems,
                math_reward,
                args.k,
                sampling,
                prompt,
                return_samples=True,
            )
            row = {
                "variant": name,
                "temperature": temperature,
                "prompt_tokens": statistics.median(
                    len(eval_lib.encode_problem(q, tokenizer, prompt)) for q in problems
                ),
                **score(res["samples"], args.k),
                "seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            print(
                f"T={temperature} {name}: boxed {row['boxed_rate']:.2f} accuracy "
                f"{row['accuracy']:.2f} plain form {row['plain_form_rate']:.2f} groups with "
                f"signal {row['groups_with_differing_boxed']:.2f}",
                flush=True,
            )
    common.print_table(
        rows,
        [
            "variant",
            "temperature",
            "prompt_tokens",
            "boxed_rate",
            "accuracy",
            "plain_form_rate",
            "plain_form_correct",
            "groups_with_differing_boxed",
            "median_answer_tokens",
        ],
    )
    common.write_result(
        "real_prompts",
        {
            "load_before": load,
            "problems": args.problems,
            "k": args.k,
            "max_new_tokens": args.max_new_tokens,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
