"""Where a real-config step's time and memory go, and the pipeline against its serial prediction.

    make real-model                                  # once
    python bench/real_profile.py                     # 10 pipeline steps, then each role alone
    python bench/real_profile.py --steps=5 --warm_cache   # with the persistent compile cache

On configs/smollm2_math.py (SmolLM2-135M-Instruct, 16 sequences of <= 288 tokens a step, a
group's 4 attempts sharing one prompt copy in rows of 448 tokens):

1. The pipeline, launched cold as a user launches it (no persistent compilation cache unless
   --warm_cache): seconds from launch to the first step, compilations per step (after warm-up
   they must be 0), peak RSS (with launch.py's malloc settings: 2 glibc arenas, free heap pages
   released before each train step; --no_trim for the ablation, into
   real_profile_no_trim.json), and where the steady steps' time goes. Engine calls are timed to
   completion (block_until_ready): decode chunks, prefill, page copies, weight preparation and
   upload; the sampler's host work is its step time minus those; the trainer's is its step
   time. Idle decode slots: 1 - generated tokens / the slot-steps the decode chunks ran.
2. The sampler alone (Sampler.generate on fresh prompts, same sampling settings) and the
   trainer alone (train_step on the batch built from those very samples: with shared prompts
   and empty micro-batches skipped, the step's cost follows the rows the batch fills), each a
   median of 3.
3. The serial prediction for one step, tokens / sampler tok/s + train step, against the
   pipeline's steady seconds per step (goal: pipeline tok/s >= 0.8x serial), and the planner's
   prediction from the same lone rates: on one shared device (its serial formula) and on 1
   sampler + 1 trainer device (what a pair of real devices would give).
4. The reward function's seconds per step, scored in this process on the lone sampler's
   completions (in a run, reward worker processes score them off the trainer's path).

Writes bench/results/real_profile.json. One shared device: the roles take turns on the cores.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from pipelinerl_jax import glibc_malloc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = common.REAL_MODEL_DIR
GOAL_PIPELINE_OVER_SERIAL = 0.8


class Timers:
    """Total seconds and calls per label of wrapped methods, each timed to completion."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()

    def wrap(self, obj, name: str, label: str, block: bool = True) -> None:
        import jax

        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            if block:
                jax.block_until_ready(out)
            self.seconds[label] += time.perf_counter() - t0
            self.calls[label] += 1
            return out

        setattr(obj, name, timed)

    def snapshot(self) -> dict:
        return {k: (self.seconds[k], self.calls[k]) for k in self.seconds}


def real_config(steps: int, warm_cache: bool, trim: bool = True):
    from configs import smollm2_math
    from pipelinerl_jax.pipeline.config_dict import from_config_dict

    c = smollm2_math.get_config()
    c.steps, c.eval_every, c.checkpoint_every, c.log_every = steps, 0, 0, 1
    c.eval.at_start = False
    c.compile_cache = "auto" if warm_cache else ""
    c.trim_host_memory = trim
    return from_config_dict(c)


def profile_pipeline(cfg, t_launch: float) -> tuple[dict, object]:
    """Runs cfg.steps pipeline steps with timed engine calls; returns (figures, components)."""
    from pipelinerl_jax.pipeline import components as build_lib
    from pipelinerl_jax.pipeline import host_memory
    from pipelinerl_jax.pipeline import runner as run_lib

    timers = Timers()
    step_wall, snapshots, stats = {}, {}, {}
    lines = []

    def echo(line):
        print(line, flush=True)
        lines.append(line)
        if line.startswith("step "):
            step = int(line.split()[1])
            step_wall[step] = time.perf_counter()
            snapshots[step] = timers.snapshot()
            stats[step] = dict(c.sampler.stats)

    c = build_lib.build(cfg)
    engine = c.sampler.engine
    for name, label in (
        ("decode_chunk", "decode"),
        ("prefill", "prefill"),
        ("copy_pages", "page_copies"),
        ("prepare_params", "weight_prepare"),
    ):
        timers.wrap(engine, name, label)
    timers.wrap(c.sampler, "_upload", "weight_upload", block=False)
    timers.wrap(c.sampler, "step", "sampler_step", block=False)
    timers.wrap(c.trainer, "train_step", "train_step")
    workdir = ROOT / "runs" / "real_profile"
    if (workdir / "metrics.jsonl").exists():
        (workdir / "metrics.jsonl").unlink()
    run_lib.run(cfg, str(workdir), components=c, echo=echo)
    peak_rss = host_memory.peak_rss_bytes()
    records = [
        r
        for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "train"
    ]

    first, last = 2, cfg.steps - 1  # steps 0-1 include compilation and the pipeline filling
    if last <= first:
        raise SystemExit("--steps must be >= 4 to leave steady steps after warm-up")
    n = last - first
    wall = step_wall[last] - step_wall[first]
    spent = {
        k: snapshots[last].get(k, (0.0, 0))[0] - snapshots[first].get(k, (0.0, 0))[0]
        for k in snapshots[last]
    }
    engine_s = sum(
        spent.get(k, 0.0)
        for k in ("decode", "prefill", "page_copies", "weight_prepare", "weight_upload")
    )
    d_tokens = stats[last]["decode_tokens"] - stats[first]["decode_tokens"]
    # The slot-steps the chunks ran (narrower than num_slots with sampler.decode_widths > 1).
    slot_steps = stats[last]["decode_slot_steps"] - stats[first]["decode_slot_steps"]
    figures = {
        "seconds_to_first_step": step_wall[0] - t_launch,
        "compiles_by_step": [r.get("compile/count", 0) for r in records],
        "compile_seconds_by_step": [round(r.get("compile/seconds", 0.0), 2) for r in records],
        "compiles_after_warmup": sum(r.get("compile/count", 0) for r in records[first:]),
        "peak_rss_gib": peak_rss / 2**30,
        # The process's peak so far at each step's end: flat once the steps' peaks repeat.
        "peak_rss_gib_by_step": [round(r["memory/peak_rss_gib"], 3) for r in records],
        "steady_steps": n,
        "steady_s_per_step": wall / n,
        "steady_generated_tokens_per_step": d_tokens / n,
        "pipeline_tokens_per_s": d_tokens / wall,
        "per_step_seconds": {
            "decode": spent.get("decode", 0.0) / n,
            "prefill": spent.get("prefill", 0.0) / n,
            "page_copies": spent.get("page_copies", 0.0) / n,
            "weight_prepare_and_upload": (
                spent.get("weight_prepare", 0.0) + spent.get("weight_upload", 0.0)
            )
            / n,
            "sampler_host": max(0.0, spent.get("sampler_step", 0.0) - engine_s) / n,
            "train_step": spent.get("train_step", 0.0) / n,
        },
        "idle_slot_fraction": 1.0 - d_tokens / max(1, slot_steps),
    }
    return figures, c


def alone(c, cfg, rounds: int = 3) -> dict:
    """The sampler alone and the trainer alone on the same kind of batch, medians of rounds."""
    import jax
    import numpy as np

    from pipelinerl_jax.rl.batch import ScoredSample, build_batch
    from pipelinerl_jax.sampler.sequence import SamplingParams

    sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    groups = cfg.batch_size // cfg.group_size
    from pipelinerl_jax.pipeline.groups import completion_text
    from pipelinerl_jax.rewards.tables import BUILTIN_REWARDS, resolve_callable

    fn = BUILTIN_REWARDS.get(cfg.reward.fn, cfg.reward.fn)
    reward_fn = resolve_callable(fn) if isinstance(fn, str) else fn
    stop_ids = tuple(getattr(c.tokenizer, "eos_token_ids", ()))
    gen_s, gen_tokens, batches, reward_s = [], [], [], []
    rng = np.random.default_rng(0)
    for r in range(rounds + 1):  # the first round warms up (the pipeline compiled already)
        problems = [next(c.stream) for _ in range(groups)]
        prompts = [c.encode_prompt(p) for p in problems]
        t0 = time.perf_counter()
        out = c.sampler.generate(prompts, n=cfg.group_size, params=sampling)
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()  # the step's rewards, in this process (the run's workers
        for i, s in enumerate(out):  # score them off the trainer's path)
            reward_fn(
                completion_text(c.tokenizer, s.token_ids, stop_ids), problems[i // cfg.group_size]
            )
        if r:
            reward_s.append(time.perf_counter() - t1)
        samples = [
            ScoredSample(
                prompt_tokens=s.prompt_ids,
                completion_tokens=s.token_ids,
                completion_logprobs=s.logprobs,
                completion_versions=s.versions,
                reward=float(rng.random()),
                group_id=i // cfg.group_size,
                finished=s.finish_reason == "stop",
            )
            for i, s in enumerate(out)
        ]
        batches.append(build_batch(samples, cfg.batch)[0])
        if r:
            gen_s.append(dt)
            gen_tokens.append(sum(len(s.token_ids) for s in out))
    state, train_s = c.state, []
    for r, batch in enumerate(batches):
        t0 = time.perf_counter()
        state, metrics = c.trainer.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        if r:
            train_s.append(time.perf_counter() - t0)
    tok_s = [t / s for t, s in zip(gen_tokens, gen_s)]
    return {
        "sampler_tokens_per_s": statistics.median(tok_s),
        "sampler_rounds_s": gen_s,
        "sampler_rounds_tokens": gen_tokens,
        "train_step_s": statistics.median(train_s),
        "train_rounds_s": train_s,
        "reward_s_per_step": statistics.median(reward_s),
    }


def planner_predictions(cfg, pipeline: dict, solo: dict) -> dict:
    """The planner's tokens/s for this config from the lone roles' rates: on one shared device
    (the serial formula: the roles take turns) and on 2 devices, 1 sampler + 1 trainer (the
    overlap a pair of real devices would give; this CPU cannot run that split)."""
    from pipelinerl_jax.plan import validate

    mean_len = pipeline["steady_generated_tokens_per_step"] / cfg.batch_size
    lengths = validate.maxent_lengths(mean_len, cfg.max_new_tokens)
    out = {}
    for name, devices in (("shared_1_device", 1), ("split_2_devices", 2)):
        shape = validate.RunShape(
            devices, 1, cfg.sampler.num_slots, cfg.batch_size, cfg.max_lag, cfg.max_new_tokens
        )
        p = validate.predict(
            shape,
            gen_tokens_per_s_per_device=solo["sampler_tokens_per_s"],
            train_step_s_per_device=solo["train_step_s"],
            lengths=lengths,
        )
        out[name] = dict(
            tokens_per_s=p["samples_per_s"] * mean_len,
            samples_per_s=p["samples_per_s"],
            bottleneck=p["bottleneck"],
            lag=p["lag"],
        )
    return out


def main() -> None:
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--warm_cache",
        action="store_true",
        help="use the persistent compilation cache (default: compile everything)",
    )
    p.add_argument(
        "--no_trim",
        action="store_true",
        help="trim_host_memory=false: the ablation, written to real_profile_no_trim.json",
    )
    args = p.parse_args()
    glibc_malloc.limit_arenas()  # as launch.py does, before JAX starts its threads
    common.require_model(MODEL_DIR)
    load = common.warn_if_busy()
    t_launch = time.perf_counter()
    cfg = real_config(args.steps, args.warm_cache, trim=not args.no_trim)
    pipeline, c = profile_pipeline(cfg, t_launch)
    solo = alone(c, cfg)
    tokens = pipeline["steady_generated_tokens_per_step"]
    serial_s = tokens / solo["sampler_tokens_per_s"] + solo["train_step_s"]
    ratio = serial_s / pipeline["steady_s_per_step"]
    planner = planner_predictions(cfg, pipeline, solo)
    out = {
        "load_before": load,
        "cpu": common.cpu_features(),
        "config": "configs/smollm2_math.py",
        "warm_cache": args.warm_cache,
        "trim_host_memory": not args.no_trim,
        "pipeline": pipeline,
        "alone": solo,
        "serial_s_per_step": serial_s,
        "planner": planner,
        "pipeline_over_serial": ratio,
        "goal_pipeline_over_serial": GOAL_PIPELINE_OVER_SERIAL,
        "meets_goal": ratio >= GOAL_PIPELINE_OVER_SERIAL,
    }
    print(
        f"first step after {pipeline['seconds_to_first_step']:.0f} s, compiles after warm-up "
        f"{pipeline['compiles_after_warmup']}, peak RSS {pipeline['peak_rss_gib']:.2f} GiB"
    )
    print(
        f"steady: {pipeline['steady_s_per_step']:.1f} s/step, {tokens:.0f} tokens/step; "
        f"alone: sampler {solo['sampler_tokens_per_s']:.0f} tok/s, train step "
        f"{solo['train_step_s']:.1f} s; serial {serial_s:.1f} s/step; pipeline/serial "
        f"{ratio:.2f} (goal >= {GOAL_PIPELINE_OVER_SERIAL})"
    )
    print(
        "tokens/s: measured {:.1f}, serial {:.1f}, planner shared {:.1f}, planner 1+1 devices "
        "{:.1f}; rewards {:.2f} s of CPU a step (in worker processes)".format(
            pipeline["pipeline_tokens_per_s"],
            tokens / serial_s,
            planner["shared_1_device"]["tokens_per_s"],
            planner["split_2_devices"]["tokens_per_s"],
            solo["reward_s_per_step"],
        )
    )
    print(
        "per step:",
        {k: round(v, 2) for k, v in pipeline["per_step_seconds"].items()},
        f"idle slots {pipeline['idle_slot_fraction']:.2f}",
    )
    common.write_result("real_profile_no_trim" if args.no_trim else "real_profile", out)


if __name__ == "__main__":
    main()
