"""Decode widths on the real config: what a decode step costs at each batch width, and the
sampler alone with `sampler.decode_widths` 1 (every slot, every step) against the config's.

    make real-model
    python bench/bench_decode_widths.py                 # f32 decode
    python bench/bench_decode_widths.py --dtype=bfloat16

On configs/smollm2_math.py (SmolLM2-135M-Instruct, 16 slots, 288-token context, the attention
window pinned to it):

1. One decode chunk (16 steps) at 16, 8, 4, 2 and 1 slots: ms a step, median of 5 chunks after
   one warm-up. A step's cost grows with the rows it runs; the width-1 figure is what the
   weights alone cost to read.
2. The sampler alone on the run's prompt stream (4 prompts x 4 attempts a round, at most 144
   new tokens at T=0.8, as a pipeline step samples them), decode_widths 1 against the config's,
   the same prompts and seeds for both: seconds a round (median of --rounds after one warm-up
   round), tokens/s, the slot-steps the decode chunks ran, and whether both sampled the same
   tokens (the draws are the same; only the matmuls' row count differs, so a token flips only
   where float rounding crosses a sampling boundary).

Writes bench/results/decode_widths.json.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

MODEL_DIR = common.REAL_MODEL_DIR


def build(dtype: str | None):
    from configs import smollm2_math
    from pipelinerl_jax.pipeline import components as build_lib
    from pipelinerl_jax.pipeline.config_dict import from_config_dict

    c = smollm2_math.get_config()
    c.steps, c.eval_every, c.checkpoint_every = 1, 0, 0
    c.eval.at_start = False
    if dtype:
        c.sampler.compute_dtype = dtype
    cfg = from_config_dict(c)
    return cfg, build_lib.build(cfg)


def step_ms_by_width(sampler, repeats: int = 5) -> dict[int, float]:
    """One decode chunk at each width on the (empty) sampler state: ms a step."""
    import jax
    import numpy as np

    k, window = sampler.config.chunk_steps, sampler.scheduler.pages_per_slot
    out = {}
    for width in (16, 8, 4, 2, 1):
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            sampler.state = sampler.engine.decode_chunk(
                sampler.params,
                sampler.state,
                np.int32(0),
                k=k,
                window=window,
                width=None if width == sampler.num_slots else width,
            )
            jax.block_until_ready(sampler.state)
            if i:
                times.append(time.perf_counter() - t0)
        out[width] = 1000 * statistics.median(times) / k
    return out


def sampler_alone(cfg, comp, widths: int, prompts) -> dict:
    from pipelinerl_jax.sampler.sampler import PagedSampler
    from pipelinerl_jax.sampler.sequence import SamplingParams

    s = PagedSampler(
        comp.graphdef,
        comp.state.params,
        dataclasses.replace(comp.sampler.config, decode_widths=widths),
        eos_token_ids=comp.sampler.eos_token_ids,
    )
    s.warm_up()
    sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    seconds, tokens, samples = [], [], []
    for r, batch in enumerate(prompts):  # round 0 warms up
        t0 = time.perf_counter()
        out = s.generate(batch, n=cfg.group_size, params=sampling)
        dt = time.perf_counter() - t0
        samples.append([x.token_ids for x in out])
        if r:
            seconds.append(dt)
            tokens.append(sum(len(x.token_ids) for x in out))
    return {
        "decode_widths": widths,
        "round_s": seconds,
        "round_tokens": tokens,
        "median_round_s": statistics.median(seconds),
        "tokens_per_s": sum(tokens) / sum(seconds),
        "slot_use": s.stats["decode_tokens"] / s.stats["decode_slot_steps"],
        "samples": samples,
    }


def main() -> None:
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    common.at_least(args.rounds, "--rounds")
    common.require_model(MODEL_DIR)
    load = common.warn_if_busy()
    cfg, comp = build(None if args.dtype == "float32" else args.dtype)
    ms = step_ms_by_width(comp.sampler)
    groups = cfg.batch_size // cfg.group_size
    prompts = [
        [comp.encode_prompt(next(comp.stream)) for _ in range(groups)]
        for _ in range(args.rounds + 1)
    ]
    configured = cfg.sampler.decode_widths
    full = sampler_alone(cfg, comp, 1, prompts)
    narrow = sampler_alone(cfg, comp, configured, prompts)
    pairs = [
        (a, b) for ra, rb in zip(full.pop("samples"), narrow.pop("samples")) for a, b in zip(ra, rb)
    ]
    result = {
        "load_before": load,
        "config": "configs/smollm2_math.py",
        "dtype": args.dtype,
        "step_ms_by_width": ms,
        "every_slot": full,
        "narrowed": narrow,
        "speedup": full["median_round_s"] / narrow["median_round_s"],
        "same_tokens_frac": sum(a == b for a, b in pairs) / len(pairs),
        "command": "python bench/bench_decode_widths.py"
        + (f" --dtype={args.dtype}" if args.dtype != "float32" else ""),
    }
    print(
        "ms a decode step by width: "
        + ", ".join(f"{w}: {v:.1f}" for w, v in ms.items())
        + f"\nsampler alone, decode_widths 1 -> {configured}: "
        f"{full['median_round_s']:.2f} -> {narrow['median_round_s']:.2f} s a round "
        f"({result['speedup']:.2f}x), slot use {full['slot_use']:.0%} -> "
        f"{narrow['slot_use']:.0%}, same tokens {result['same_tokens_frac']:.0%}"
    )
    name = "decode_widths" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    common.write_result(name, result)


if __name__ == "__main__":
    main()
