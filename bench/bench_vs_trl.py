"""The whole RL step against TRL: SmolLM2-135M-Instruct on the real task, ours vs GRPOTrainer.

    make real-model
    .venv/bin/pip install -r requirements-bench.txt     # trl 1.16 (and datasets), pinned
    python bench/bench_vs_trl.py                        # TRL 6 steps; ours 24 + 12 steps
    python bench/bench_vs_trl.py --trl_steps=4 --pipeline_steps=12 --conventional_steps=6
    python bench/bench_vs_trl.py --lora_rank=16         # LoRA on both sides (TRL with peft)
    python bench/bench_vs_trl.py --sampler_dtype=bfloat16   # ours decodes in bf16
    python bench/bench_vs_trl.py --compute_dtype=bfloat16   # both sides train in bf16
    python bench/bench_vs_trl.py --decode_widths=1      # ablation: decode every slot

Both sides start from the same f32 weights and train on the same prompts in the same order
(the first 4 x steps word problems of our prompt stream for configs/smollm2_math.py, with its
one-shot chat prompt), rewarded by the same function (math-verify on the last \\boxed{}: 0.9
for a right answer, +0.3 for a finished parsed one), 4 groups x 4 completions a step, at most
144 new tokens at temperature 0.8, AdamW at a constant 1e-5 with no warm-up, no weight decay,
global-norm clipping at 1.0, no KL term, f32 throughout, on the same two CPU cores.

The objective is matched to TRL 1.16's defaults: TRL's `loss_type="dapo"` (token-level sum
over the batch's completion tokens divided by their count), `scale_rewards="group"`
(advantages divided by the group's reward std), `epsilon=0.2` (clip 0.8..1.2), token-level
importance sampling. Ours runs `loss.objective="ppo"` with eps 0.2 / 0.2,
`batch.normalize_std=True` and `batch.weighting="token_mean"`. TRL is strictly on-policy
(`num_iterations=1`: its ratios are exactly 1); ours in pipeline mode trains tokens up to
`max_lag=1` versions old (ratios near 1), and in conventional mode (one step per round, the
roles taking turns) on-policy. Remaining differences: TRL generates with padded HF `generate`
and recomputes logprobs in its train forward; it uses gradient checkpointing (its default).

Each side runs in its own process, one after the other (peak RSS is per process): TRL, then
ours in pipeline mode, then ours in conventional mode. Reported per side: seconds per step
(median after the first two steps), samples/s and completion tokens/s, peak RSS, launch to
first step, the mean sampled reward per step, and the sampled reward of the steps finished
within TRL's training time (reward after equal wall time, counted from each side's first
optimizer step). Writes bench/results/vs_trl.json.

With `--lora_rank=R` both sides train rank-R adapters (alpha 32, all seven projections, no
dropout) on the frozen base at LoRA's learning rate, 1e-4 (docs/lora.md says why): ours with
`model.lora`, TRL with a `peft.LoraConfig` given to GRPOTrainer. Writes vs_trl_lora.json.

With `--sampler_dtype=bfloat16` our sampler decodes in bf16 (`sampler.compute_dtype`) while
our trainer and TRL stay f32: the sampled tokens change, so the result also carries each side's
reward and our sampler/trainer logprob mismatch at equal version (mismatch/* of the metrics),
for f32 and bf16 alike. Writes vs_trl_bf16_sampler.json.

With `--compute_dtype=bfloat16` both sides train with bf16 matmuls on f32 master weights, each
its own way: ours with `model.compute_dtype=bfloat16` (the sampler follows it, so it decodes
in bf16 too), TRL with `bf16=True` (torch autocast on CPU, as its Trainer sets it up). Writes
vs_trl_bf16.json.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = common.REAL_MODEL_DIR
GROUP, BATCH, MAX_NEW, TEMPERATURE, LR = 4, 16, 144, 0.8, 1e-5
WARMUP_STEPS = 2  # steps excluded from the steady-state figures
GOAL = {"samples_per_s_ratio": 3.0}
LORA_ALPHA, LORA_LR = 32, 1e-4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def real_config(
    steps: int,
    mode: str,
    lora_rank: int = 0,
    weighting: str = "token_mean",
    sampler_dtype: str = "float32",
    decode_widths: int = 0,
    compute_dtype: str = "float32",
):
    """configs/smollm2_math.py with TRL's objective, no evaluation and no checkpoints.
    decode_widths: our sampler's (0: the config's).

    `weighting`: how token losses are aggregated; TRL's dapo is "token_mean" (the default),
    bench/bench_vs_tunix.py passes Tunix GRPO's "sequence_mean"."""
    from configs import smollm2_math
    from pipelinerl_jax.pipeline.config_dict import from_config_dict

    c = smollm2_math.get_config()
    if lora_rank:
        c.model.lora = dict(rank=lora_rank, alpha=float(LORA_ALPHA), targets=LORA_TARGETS)
        c.trainer.learning_rate = LORA_LR
    c.steps, c.mode, c.conventional_steps = steps, mode, 1
    if sampler_dtype != "float32":
        c.sampler.compute_dtype = sampler_dtype
    c.model.compute_dtype = compute_dtype
    if decode_widths:
        c.sampler.decode_widths = decode_widths
    c.eval_every, c.checkpoint_every, c.log_every = 0, 0, 1
    c.eval.at_start = False
    c.trainer.warmup_steps = 0
    c.loss.objective = "ppo"
    c.loss.ppo_eps_low = c.loss.ppo_eps_high = 0.2
    c.batch.normalize_std = True
    c.batch.weighting = weighting
    cfg = from_config_dict(c)
    assert (cfg.group_size, cfg.batch_size, cfg.max_new_tokens, cfg.temperature) == (
        GROUP,
        BATCH,
        MAX_NEW,
        TEMPERATURE,
    )
    assert cfg.trainer.learning_rate == (LORA_LR if lora_rank else LR)
    assert cfg.trainer.grad_clip_norm == 1.0
    return cfg


def stream_problems(cfg, n: int) -> list:
    """The first n problems of the prompt stream a run of cfg trains on, in order."""
    from pipelinerl_jax.data.datasets import PromptStream
    from pipelinerl_jax.pipeline.components import build_data

    _, source, _ = build_data(cfg)
    stream = PromptStream(source, seed=cfg.data.shuffle_seed + cfg.seed)
    return [next(stream) for _ in range(n)]


def steady(
    times: list[float], rewards: list[float], tokens: list[float], budget_s: float | None
) -> dict:
    """Figures from per-step end times (seconds since the side's start), rewards and
    completion tokens."""
    skip = WARMUP_STEPS if len(times) > WARMUP_STEPS + 1 else 0  # short runs: every step
    gaps = [b - a for a, b in zip(times[skip:], times[skip + 1 :])] or [times[0]]
    s_per_step = statistics.median(gaps)
    out = {
        "steps": len(times),
        "launch_to_first_step_s": times[0],
        "s_per_step": s_per_step,
        "samples_per_s": BATCH / s_per_step,
        "completion_tokens_per_s": statistics.median(tokens[skip + 1 :] or tokens) / s_per_step,
        "reward_by_step": rewards,
        "reward_mean": statistics.mean(rewards),
        "train_s": times[-1] - times[0],
        "step_end_s": [t - times[0] for t in times],
    }
    if budget_s is not None:
        within = [r for t, r in zip(times, rewards) if t - times[0] <= budget_s]
        out["equal_time_steps"] = len(within)
        out["equal_time_reward_last3"] = statistics.mean(within[-3:])
    return out


def trl_worker(steps: int, out: Path, lora_rank: int = 0, compute_dtype: str = "float32") -> None:
    t_launch = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipelinerl_jax.data.formats import Problem
    from pipelinerl_jax.data.prompts import build_messages
    from pipelinerl_jax.pipeline.components import prompt_config
    from pipelinerl_jax.rewards.math import math_reward
    from pipelinerl_jax.rewards.tables import get_reward_table

    cfg = real_config(steps, "pipeline", lora_rank)
    problems = stream_problems(cfg, BATCH // GROUP * steps)
    pcfg = prompt_config(cfg.data)
    table = get_reward_table(cfg.reward.table, **dict(cfg.reward.table_options))
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    eos = {tok.eos_token_id}
    data = Dataset.from_dict(
        {
            "prompt": [build_messages(p.question, pcfg) for p in problems],
            "uid": [p.uid for p in problems],
            "question": [p.question for p in problems],
            "gold": [p.answer for p in problems],
            "source": [p.source for p in problems],
        }
    )

    def reward(prompts, completions, completion_ids, uid, question, gold, source, **_):
        scores = []
        for c, ids, u, q, a, s in zip(completions, completion_ids, uid, question, gold, source):
            verdict = math_reward(c[0]["content"], Problem(uid=u, question=q, answer=a, source=s))
            finished = len(ids) < MAX_NEW or (len(ids) > 0 and int(ids[-1]) in eos)
            scores.append(
                table.compute(
                    verdict, num_tokens=len(ids), max_tokens=MAX_NEW, finished=finished
                ).reward
            )
        return scores

    ends, records = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter() - t_launch)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                records.append(dict(logs, step=state.global_step))

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=compute_dtype == "bfloat16",  # torch autocast, f32 master weights
            seed=0,
            max_steps=steps,
            learning_rate=LORA_LR if lora_rank else LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            per_device_train_batch_size=BATCH,
            num_generations=GROUP,
            gradient_accumulation_steps=1,
            max_completion_length=MAX_NEW,
            temperature=TEMPERATURE,
            top_k=0,
            top_p=1.0,
            beta=0.0,
            loss_type="dapo",
            scale_rewards="group",
            epsilon=0.2,
            importance_sampling_level="token",
            num_iterations=1,
            gradient_checkpointing=True,
            shuffle_dataset=False,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
        )
        peft_config = None
        if lora_rank:
            from peft import LoraConfig

            peft_config = LoraConfig(
                r=lora_rank,
                lora_alpha=LORA_ALPHA,
                target_modules=LORA_TARGETS,
                lora_dropout=0.0,
                bias="none",
                task_type="CAUSAL_LM",
            )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=data,
            processing_class=tok,
            callbacks=[Clock()],
            peft_config=peft_config,
        )
        trainer.train()
    rewards = [float(r["reward"]) for r in records]  # TRL logs numbers as strings
    tokens = [float(r["completions/mean_length"]) * BATCH for r in records]
    result = steady(ends, rewards, tokens, None)
    result["prompts"] = [p.uid for p in problems]
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result["logs"] = records
    out.write_text(json.dumps(result))


def ratios(peer: dict, ours: dict, conv: dict) -> dict:
    """Both of our modes against a peer's side, and the goals: the result's shared fields
    (bench_vs_tunix.py writes the same ones)."""
    ratio = ours["samples_per_s"] / peer["samples_per_s"]
    return {
        "pipeline": ours,
        "conventional": conv,
        "samples_per_s_ratio": ratio,
        "conventional_samples_per_s_ratio": conv["samples_per_s"] / peer["samples_per_s"],
        "peak_rss_ratio": ours["peak_rss_gib"] / peer["peak_rss_gib"],
        "goal": GOAL,
        "meets_speed_goal": ratio >= GOAL["samples_per_s_ratio"],
        "meets_memory_goal": ours["peak_rss_gib"] <= peer["peak_rss_gib"],
    }


def ours_worker(
    steps: int,
    mode: str,
    budget_s: float | None,
    out: Path,
    lora_rank: int = 0,
    weighting: str = "token_mean",
    sampler_dtype: str = "float32",
    decode_widths: int = 0,
    compute_dtype: str = "float32",
) -> None:
    t_launch = time.perf_counter()
    from pipelinerl_jax.pipeline import runner as run_lib

    cfg = real_config(
        steps, mode, lora_rank, weighting, sampler_dtype, decode_widths, compute_dtype
    )
    first_step = []

    def echo(line: str) -> None:
        print(line, flush=True)
        if line.startswith("step ") and not first_step:
            first_step.append(time.perf_counter() - t_launch)

    with tempfile.TemporaryDirectory() as workdir:
        run_lib.run(cfg, workdir, echo=echo)
        records = [
            json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()
        ]
    train = [r for r in records if r["kind"] == "train"]
    times = [r["time"] for r in train]  # seconds since the run's metrics writer started
    rewards = [r["reward/mean"] for r in train]
    tokens = [r["completion/len_mean"] * BATCH for r in train]
    result = steady(times, rewards, tokens, budget_s)
    result["launch_to_first_step_s"] = first_step[0]
    result["peak_rss_gib"] = max(r.get("memory/peak_rss_gib", 0.0) for r in train)
    result["prompts"] = [u for r in train for u in r["prompts"]]
    result["decode_widths"] = cfg.sampler.decode_widths
    # Sampler/trainer logprob gap on the tokens trained at their own version (numerics alone).
    gaps = [r for r in train if r.get("mismatch/tokens_frac", 0) > 0]
    for key in ("mismatch/abs_mean", "mismatch/abs_max", "mismatch/kl"):
        values = [r[key] for r in gaps]
        result[key.replace("/", "_")] = statistics.mean(values) if values else None
    out.write_text(json.dumps(result))


def run_side(args: list[str], cmd: list[str] | None = None) -> dict:
    """Runs one side in its own process (`cmd`, default this script under this Python) with
    `args` and --out=<a temporary JSON file>; returns that file's result."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [*(cmd or [sys.executable, __file__]), *args, f"--out={out}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    result = json.loads(out.read_text())
    result["process_wall_s"] = time.perf_counter() - t0
    out.unlink()
    return result


def main() -> int | None:
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trl_steps", type=int, default=6)
    p.add_argument("--pipeline_steps", type=int, default=24)
    p.add_argument("--conventional_steps", type=int, default=12)
    p.add_argument("--worker", choices=("trl", "pipeline", "conventional"), default=None)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--budget_s", type=float, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--lora_rank", type=int, default=0, help="0: full fine-tuning")
    p.add_argument(
        "--sampler_dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="our sampler's compute dtype (the trainers stay f32)",
    )
    p.add_argument(
        "--compute_dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="both sides' matmuls (f32 master weights): ours model.compute_dtype, TRL bf16=True",
    )
    p.add_argument(
        "--decode_widths",
        type=int,
        default=0,
        help="our sampler.decode_widths (0: the config's; 1: every slot every step)",
    )
    args = p.parse_args()
    if args.compute_dtype != "float32" and args.sampler_dtype != "float32":
        print(
            "bench_vs_trl.py: --compute_dtype already sets our sampler's dtype (it follows the "
            "model's); drop --sampler_dtype",
            file=sys.stderr,
        )
        return 2
    for flag in ("trl_steps", "pipeline_steps", "conventional_steps"):
        common.at_least(getattr(args, flag), f"--{flag}")
    common.at_least(args.lora_rank, "--lora_rank", minimum=0)
    common.at_least(args.decode_widths, "--decode_widths", minimum=0)
    if args.worker == "trl":
        return trl_worker(args.steps, Path(args.out), args.lora_rank, args.compute_dtype)
    if args.worker:
        return ours_worker(
            args.steps,
            args.worker,
            args.budget_s,
            Path(args.out),
            args.lora_rank,
            sampler_dtype=args.sampler_dtype,
            decode_widths=args.decode_widths,
            compute_dtype=args.compute_dtype,
        )
    common.require_model(MODEL_DIR)
    try:
        import trl  # noqa: F401
    except ImportError:
        common.refuse("trl is not installed: .venv/bin/pip install -r requirements-bench.txt")
    load = common.warn_if_busy()
    lora = [
        f"--lora_rank={args.lora_rank}",
        f"--sampler_dtype={args.sampler_dtype}",
        f"--decode_widths={args.decode_widths}",
        f"--compute_dtype={args.compute_dtype}",
    ]
    trl_side = run_side(["--worker=trl", f"--steps={args.trl_steps}", *lora])
    budget = trl_side["train_s"]
    ours = run_side(
        ["--worker=pipeline", f"--steps={args.pipeline_steps}", f"--budget_s={budget}", *lora]
    )
    conv = run_side(
        [
            "--worker=conventional",
            f"--steps={args.conventional_steps}",
            f"--budget_s={budget}",
            *lora,
        ]
    )
    # Same prompts, same order: TRL's dataset is the stream's first problems, unshuffled.
    n = len(trl_side["prompts"])
    assert ours["prompts"][:n] == trl_side["prompts"], "the two sides trained other prompts"
    trl_side["equal_time_steps"] = trl_side["steps"]
    trl_side["equal_time_reward_last3"] = statistics.mean(trl_side["reward_by_step"][-3:])
    result = {
        "load_before": load,
        "model": "SmolLM2-135M-Instruct (f32)",
        "sampler_dtype": args.sampler_dtype,
        "compute_dtype": args.compute_dtype,
        "lora": {"rank": args.lora_rank, "alpha": LORA_ALPHA, "targets": LORA_TARGETS}
        if args.lora_rank
        else None,
        "command": "python bench/bench_vs_trl.py"
        + (f" --lora_rank={args.lora_rank}" if args.lora_rank else "")
        + (f" --sampler_dtype={args.sampler_dtype}" if args.sampler_dtype != "float32" else "")
        + (f" --compute_dtype={args.compute_dtype}" if args.compute_dtype != "float32" else "")
        + (f" --decode_widths={args.decode_widths}" if args.decode_widths else "")
        + "".join(
            f" --{name}={getattr(args, name)}"
            for name, default in (
                ("trl_steps", 6),
                ("pipeline_steps", 24),
                ("conventional_steps", 12),
            )
            if getattr(args, name) != default
        ),
        "decode_widths": ours["decode_widths"],
        "config": "configs/smollm2_math.py, objective matched to TRL (see the docstring)",
        "trl": trl_side,
        **ratios(trl_side, ours, conv),
    }
    for name, side in (
        ("TRL GRPOTrainer", trl_side),
        ("ours, pipeline", ours),
        ("ours, conventional", conv),
    ):
        print(
            f"{name}: {side['s_per_step']:.1f} s/step, {side['samples_per_s']:.2f} samples/s, "
            f"{side['completion_tokens_per_s']:.1f} completion tok/s, peak RSS "
            f"{side['peak_rss_gib']:.2f} GiB, mean reward {side['reward_mean']:.3f}, reward "
            f"of the last 3 steps within TRL's time {side['equal_time_reward_last3']:.3f} "
            f"({side['equal_time_steps']} steps)"
            + (
                f", logprob gap at equal version {side['mismatch_abs_mean']:.4f} mean"
                if side.get("mismatch_abs_mean") is not None
                else ""
            )
        )
    print(
        f"pipeline / TRL samples/s: {result['samples_per_s_ratio']:.2f}x (goal >= {GOAL['samples_per_s_ratio']}), "
        f"peak RSS {result['peak_rss_ratio']:.2f}x of TRL's"
    )
    name = "vs_trl_lora" if args.lora_rank else "vs_trl"
    if args.sampler_dtype != "float32":
        name += "_bf16_sampler"
    if args.compute_dtype != "float32":
        name += "_bf16"
    if args.decode_widths:  # an ablation: the tables keep the config's setting
        name += f"_decode_widths{args.decode_widths}"
    common.write_result(name, result)


if __name__ == "__main__":
    raise SystemExit(main())
