"""The whole RL step against Tunix: SmolLM2-135M-Instruct on the real task, ours vs GRPOLearner.

    make real-model
    make tunix-venv                                     # .venv-tunix: google-tunix 0.1.7, pinned
    python bench/bench_vs_tunix.py                      # Tunix 6 steps; ours 24 + 12 steps
    python bench/bench_vs_tunix.py --tunix_steps=4 --pipeline_steps=12 --conventional_steps=6
    python bench/bench_vs_tunix.py --quick              # 3 steps a side: does it all run?

Tunix (google-tunix 0.1.7, Google's JAX post-training library) runs its full GRPO loop on CPU:
`GRPOLearner` over an `RLCluster` with the vanilla rollout (its own JAX sampler and KV cache)
and its Llama3 model loaded from our safetensors. Its side runs under its own venv,
.venv-tunix (its dependencies clash with ours: it needs safetensors < 0.8, we pin 0.8.0; jax
0.10.2 and flax 0.12.8 there are the same as ours, so both sides run the same XLA), as
`.venv-tunix/bin/python bench/tunix_worker.py`. Data flow: a worker of this script under our
venv renders the prompts with our pipeline (chat text and token ids) and our model's logprobs
of the first prompt into a JSON file; the Tunix worker tokenizes the text itself and asserts it
gets our ids, checks its model's logprobs against ours (max |difference| < 1e-3 nats), trains,
and computes rewards inside Tunix's reward callback with our own reward code
(pipelinerl_jax.rewards, pure Python over math-verify 0.9.0, pinned alike in both venvs).

Both sides start from the same f32 weights and train on the same prompts in the same order
(the first 4 x steps word problems of our prompt stream for configs/smollm2_math.py, with its
one-shot chat prompt; asserted), rewarded by the same function (math-verify on the last
\\boxed{}: 0.9 for a right answer, +0.3 for a finished parsed one), 4 groups x 4 completions a
step, prompts <= 144 tokens, at most 144 new tokens at temperature 0.8 (top-p 1, no top-k),
AdamW at a constant 1e-5 with no warm-up and no weight decay (b1 0.9, b2 0.999, eps 1e-8),
global-norm clipping at 1.0, no KL term, f32 throughout, on the same CPU cores.

The objective is matched to Tunix GRPO's defaults: `loss_agg_mode="sequence-mean-token-mean"`
(each completion's token mean, then the mean over completions) is our
`batch.weighting="sequence_mean"`; `epsilon=0.2` (ratio clipped to 0.8..1.2; epsilon_high
defaults to epsilon) is our `loss.objective="ppo"` with eps 0.2 / 0.2; the "grpo" advantage
((r - group mean) / (group std + 1e-6)) is our `batch.normalize_std=True`. Tunix's default
`beta=0.04` (a KL term to a reference model) is set to 0: no KL, no reference model, as on our
side. `num_iterations=1`: strictly on-policy, one update per batch (its ratios are exactly 1);
ours in pipeline mode trains tokens up to `max_lag=1` versions old (ratios near 1), in
conventional mode on-policy. Both divide the train logits by the sampling temperature.
Not matched (Tunix has no switch for them): Tunix's group std has ddof=1, ours ddof=0 (its
advantages are sqrt(3/4) = 0.87x ours at G=4; AdamW's normalisation makes that a small step-
size difference); Tunix's completions stop before the EOS token, which it never trains on
(ours trains the EOS); Tunix pads every prompt to 144 tokens and every completion to 144 in
its train step (16 x 288 tokens a step, no micro-batching or remat by default), ours packs
the real tokens (the 4 attempts of a prompt share one copy of it) into one-row micro-batches
with per-layer remat; Tunix's sampler decodes all 16 rows until the last one stops, ours
refills slots. `--tunix_train_micro_batch=N` gives Tunix gradient accumulation over N-prompt
micro-batches (its peak RSS was 19.1 GiB at its default, 10.9 GiB with N=1, on 2 cores).

Tunix needs three changes to run this model correctly (bench/tunix_worker.py's docstring has
the details; all recorded under "tunix" in the JSON): its Llama3 ignores the config's
rope_theta (always 1e6; SmolLM2 uses 1e5; unpatched its logprobs are ~1 nat off ours), so the
worker binds the config's value; SmolLM2's pad token is its EOS <|im_end|>, which Tunix would
mask out of every prompt (4 per prompt here), so pad is set to <|endoftext|>; and the mesh
has Auto axes (jax.make_mesh's Explicit ones fail in Tunix's embedding lookup).

Each side runs in its own process, one after the other (peak RSS is per process): Tunix, then
ours in pipeline mode, then ours in conventional mode. Reported per side: seconds per step
(median after the first two steps), samples/s and completion tokens/s (Tunix's count the
sampled EOS, as ours do), peak RSS, launch to first step (Tunix's excludes its model check),
the mean sampled reward per step, and the sampled reward of the steps finished within Tunix's
training time (reward after equal wall time, counted from each side's first optimizer step);
for Tunix also each step's seconds in its rollout and in its train step (`generate_s`,
`update_s`; the first train step's includes its compile). The goal is bench_vs_trl.py's: 3x
the peer's samples/s at no more than its memory. Writes bench/results/vs_tunix.json (--quick:
vs_tunix_quick.json, not committed).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.bench_vs_trl import (  # noqa: E402
    BATCH,
    GROUP,
    MODEL_DIR,
    ROOT,
    ours_worker,
    ratios,
    real_config,
    run_side,
    steady,
    stream_problems,
)

TUNIX_PY = ROOT / ".venv-tunix" / "bin" / "python"
TUNIX_WORKER = Path(__file__).resolve().parent / "tunix_worker.py"
WEIGHTING = "sequence_mean"  # Tunix GRPO's loss_agg_mode "sequence-mean-token-mean"
QUICK_STEPS = 3


def run_here(args: list[str]) -> dict:
    """One of this script's workers in its own process (bench_vs_trl.run_side would start
    bench_vs_trl.py's)."""
    return run_side(args, cmd=[sys.executable, __file__])


def config(steps: int, mode: str):
    """configs/smollm2_math.py with Tunix GRPO's objective (bench_vs_trl.real_config's with
    sequence-mean aggregation)."""
    cfg = real_config(steps, mode, weighting=WEIGHTING)
    assert (cfg.top_p, cfg.top_k) == (1.0, 0)
    loss = cfg.trainer.loss
    assert (loss.objective, loss.ppo_eps_low, loss.ppo_eps_high) == ("ppo", 0.2, 0.2)
    assert loss.kl_coef == 0.0 and loss.entropy_coef == 0.0
    assert cfg.trainer.weight_decay == 0.0 and cfg.trainer.warmup_steps == 0
    return cfg


def reference_logprobs(ids: list[int]) -> list[float]:
    """Our model's log p(ids[t] | ids[:t]), t >= 1: Tunix's model must reproduce them."""
    import jax
    import jax.numpy as jnp

    from pipelinerl_jax.models import decoder, hf_io

    _, graphdef, params = hf_io.load_hf(MODEL_DIR)
    tokens = jnp.asarray(ids, jnp.int32)[None]
    logits = decoder.jit_forward(graphdef, params, tokens, jnp.arange(len(ids))[None])
    logp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
    return jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0].tolist()


def prepare_worker(steps: int, out: Path) -> None:
    """The Tunix worker's input: the run's settings, the prompts it trains on (our chat text
    and token ids, in stream order) and our logprobs of the first prompt."""
    from pipelinerl_jax.data.prompts import build_prompt
    from pipelinerl_jax.pipeline.components import build_data, prompt_config

    cfg = config(steps, "pipeline")
    tokenizer, _, encode = build_data(cfg)
    pcfg = prompt_config(cfg.data)
    rows = [
        {
            "uid": p.uid,
            "question": p.question,
            "answer": p.answer,
            "source": p.source,
            "text": build_prompt(p.question, tokenizer, pcfg),
            "ids": [int(i) for i in encode(p)],
        }
        for p in stream_problems(cfg, BATCH // GROUP * steps)
    ]
    assert max(len(r["ids"]) for r in rows) <= cfg.max_prompt_tokens
    settings = {
        "model_dir": str(MODEL_DIR.relative_to(ROOT)),
        "group": cfg.group_size,
        "batch": cfg.batch_size,
        "prompts_per_step": cfg.batch_size // cfg.group_size,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "learning_rate": cfg.trainer.learning_rate,
        "grad_clip_norm": cfg.trainer.grad_clip_norm,
        "epsilon": cfg.trainer.loss.ppo_eps_low,
        "reward_table": cfg.reward.table,
        "reward_table_options": dict(cfg.reward.table_options),
        "eos_token_ids": [int(i) for i in tokenizer.eos_token_ids],
    }
    payload = {"settings": settings, "rows": rows}
    payload["reference_logprobs"] = reference_logprobs(rows[0]["ids"])
    out.write_text(json.dumps(payload))


def tunix_side(steps: int, train_micro_batch: int) -> dict:
    """Prepares the prompts (our venv), runs Tunix's worker (its venv) and summarises it."""
    data = run_here(["--worker=prepare", f"--steps={steps}"])
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(data, f)
    try:
        raw = run_side(
            [f"--data={f.name}", f"--steps={steps}", f"--train_micro_batch={train_micro_batch}"],
            cmd=[str(TUNIX_PY), str(TUNIX_WORKER)],
        )
    finally:
        Path(f.name).unlink()
    result = steady(raw["step_end_s"], raw["rewards"], raw["completion_tokens"], None)
    keep = ("prompts", "peak_rss_gib", "generate_s", "update_s", "model_check", "versions")
    result.update({k: raw[k] for k in keep}, process_wall_s=raw["process_wall_s"])
    result["own_pad_tokens_per_prompt"] = raw["own_pad_tokens_per_prompt"]
    result["train_micro_batch"] = raw["train_micro_batch"] or None  # None: Tunix's default
    result["equal_time_steps"] = result["steps"]
    result["equal_time_reward_last3"] = statistics.mean(result["reward_by_step"][-3:])
    return result


def check_tunix_venv() -> None:
    common.require_model(MODEL_DIR)
    if not TUNIX_PY.exists():
        common.refuse(f"{TUNIX_PY} is missing: run `make tunix-venv` first")


def report(result: dict) -> None:
    for name, key in (
        ("Tunix GRPOLearner", "tunix"),
        ("ours, pipeline", "pipeline"),
        ("ours, conventional", "conventional"),
    ):
        side = result[key]
        print(
            f"{name}: {side['s_per_step']:.1f} s/step, {side['samples_per_s']:.2f} samples/s, "
            f"{side['completion_tokens_per_s']:.1f} completion tok/s, peak RSS "
            f"{side['peak_rss_gib']:.2f} GiB, launch to first step "
            f"{side['launch_to_first_step_s']:.0f} s, mean reward {side['reward_mean']:.3f}, "
            f"reward of the last 3 steps within Tunix's time "
            f"{side['equal_time_reward_last3']:.3f} ({side['equal_time_steps']} steps)"
        )
    print(
        f"pipeline / Tunix samples/s: {result['samples_per_s_ratio']:.2f}x, conventional / "
        f"Tunix: {result['conventional_samples_per_s_ratio']:.2f}x, peak RSS "
        f"{result['peak_rss_ratio']:.2f}x of Tunix's"
    )


def main() -> None:
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tunix_steps", type=int, default=6)
    p.add_argument("--pipeline_steps", type=int, default=24)
    p.add_argument("--conventional_steps", type=int, default=12)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps a side")
    p.add_argument(
        "--tunix_train_micro_batch",
        type=int,
        default=0,
        help="prompts per Tunix gradient-accumulation micro-batch (0: its default, none)",
    )
    p.add_argument("--worker", choices=("prepare", "pipeline", "conventional"), default=None)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--budget_s", type=float, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    for flag in ("tunix_steps", "pipeline_steps", "conventional_steps"):
        common.at_least(getattr(args, flag), f"--{flag}")
    common.at_least(args.tunix_train_micro_batch, "--tunix_train_micro_batch", minimum=0)
    if args.worker == "prepare":
        return prepare_worker(args.steps, Path(args.out))
    if args.worker:
        return ours_worker(
            args.steps, args.worker, args.budget_s, Path(args.out), weighting=WEIGHTING
        )
    common.quick_alone(args, p, ("tunix_steps", "pipeline_steps", "conventional_steps"))
    check_tunix_venv()
    if args.quick:
        args.tunix_steps = args.pipeline_steps = args.conventional_steps = QUICK_STEPS
    load = common.warn_if_busy()
    tunix = tunix_side(args.tunix_steps, args.tunix_train_micro_batch)
    budget = [f"--budget_s={tunix['train_s']}"]
    ours = run_here(["--worker=pipeline", f"--steps={args.pipeline_steps}", *budget])
    conv = run_here(["--worker=conventional", f"--steps={args.conventional_steps}", *budget])
    # Same prompts, same order: Tunix's batches are the stream's first problems, unshuffled.
    n = len(tunix["prompts"])
    assert ours["prompts"][:n] == tunix["prompts"], "the two sides trained other prompts"
    assert conv["prompts"][:n] == tunix["prompts"], "the two sides trained other prompts"
    result = {
        "load_before": load,
        "model": "SmolLM2-135M-Instruct (f32)",
        "command": "python bench/bench_vs_tunix.py" + (" --quick" if args.quick else ""),
        "config": "configs/smollm2_math.py, objective matched to Tunix GRPO (see the docstring)",
        "tunix": tunix,
        **ratios(tunix, ours, conv),
    }
    report(result)
    common.write_result("vs_tunix_quick" if args.quick else "vs_tunix", result)


if __name__ == "__main__":
    main()
