"""LoRA in the sampler: decoding through the adapters against decoding merged weights.

    python bench/bench_lora_decode.py            # ~4 min; the machine must be idle
    python bench/bench_lora_decode.py --quick    # tiny shapes: checks that it runs

A LoRA sampler can run x·W + (alpha / rank)·(x·A)·B as it is (our sampler's way: each swap
converts the adapters alone), or fold the adapters into W at every swap and decode the merged
weights. Merged weights have the base model's shapes, so decoding them costs what decoding the
base costs; folding costs a whole-weight rewrite per version, which is what a full fine-tune's
swap converts. So this measures, on SmolLM2-135M's shapes (f32, random weights, rank 16 on all
seven projections):

- decode tokens/s of the unmerged LoRA sampler and of the base model's sampler (= merged),
  16 slots, 100-token prompts, 128 new tokens, temperature 1, alternating, medians;
- per swap: `PagedSampler.prepare` of the adapters alone (unmerged) and of the whole model (what
  folding rewrites, the merged path's floor).

Writes bench/results/lora_decode.json; the verdict (which is faster per step at a given
number of decode steps per swap) goes with it.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

SMOLLM2_135M = common.SMOLLM2_135M
LORA = {"rank": 16, "alpha": 32.0}


def main() -> int:
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    common.at_least(args.repeats, "--repeats")

    import jax
    import numpy as np

    from pipelinerl_jax.models import decoder, lora
    from pipelinerl_jax.sampler.config import SamplerConfig
    from pipelinerl_jax.sampler.sampler import PagedSampler
    from pipelinerl_jax.sampler.sequence import SamplingParams

    load = common.warn_if_busy()
    base_cfg = common.bench_model_config(quick=args.quick)
    if not args.quick:
        base_cfg = dataclasses.replace(base_cfg, **SMOLLM2_135M)
    lora_cfg = dataclasses.replace(base_cfg, lora=LORA)
    slots, prompt_len, new = (4, 8, 8) if args.quick else (16, 100, 128)
    scfg = SamplerConfig(num_slots=slots, max_seq_len=prompt_len + new + 16, chunk_steps=16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, base_cfg.vocab_size, prompt_len).tolist() for _ in range(slots)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=new)

    g_base, p_base = decoder.init(base_cfg, jax.random.key(0))
    g_lora, p_lora = decoder.init(lora_cfg, jax.random.key(0))
    samplers = {
        "merged (base shapes)": PagedSampler(g_base, p_base, scfg),
        "unmerged LoRA": PagedSampler(g_lora, p_lora, scfg),
    }
    for s in samplers.values():  # compile every shape first
        s.generate(prompts, params=sp)
    times = {name: [] for name in samplers}
    tokens = {}
    for _ in range(args.repeats):  # alternating, so drifts in load hit both
        for name, s in samplers.items():
            t0 = time.perf_counter()
            out = s.generate(prompts, params=sp)
            times[name].append(time.perf_counter() - t0)
            tokens[name] = sum(len(o.token_ids) for o in out)
    adapters = lora.split(p_lora)[0]
    swap = {
        "unmerged LoRA": common.median_time(
            lambda: jax.block_until_ready(samplers["unmerged LoRA"].prepare(adapters)),
            repeats=args.repeats,
            warmup=1,
        ),
        "merged (base shapes)": common.median_time(
            lambda: jax.block_until_ready(samplers["merged (base shapes)"].prepare(p_base)),
            repeats=args.repeats,
            warmup=1,
        ),
    }
    rows = []
    for name in samplers:
        med = statistics.median(times[name])
        rows.append(
            {
                "sampler": name,
                "decode_tok_s": tokens[name] / med,
                "generate_s": times[name],
                "swap_prepare_ms": 1e3 * swap[name][0],
                "swap_prepare_s": swap[name][1],
            }
        )
    common.print_table(rows, ["sampler", "decode_tok_s", "swap_prepare_ms"])
    unmerged, merged = rows[1], rows[0]
    # Per decode step of the 16-slot batch, at one swap every `chunk_steps` steps (the pipeline's
    # most frequent swapping: one per chunk), the swap's cost spread over the chunk's steps.
    step_unmerged = slots / unmerged["decode_tok_s"] + unmerged["swap_prepare_ms"] / 1e3 / 16
    step_merged = slots / merged["decode_tok_s"] + merged["swap_prepare_ms"] / 1e3 / 16
    pick = "unmerged" if step_unmerged <= step_merged else "merged"
    print(
        f"per decode step with a swap every chunk: unmerged {step_unmerged * 1e3:.1f} ms, "
        f"merged {step_merged * 1e3:.1f} ms: {pick}"
    )
    common.write_result(
        "lora_decode_quick" if args.quick else "lora_decode",
        {
            "config": {
                "model": "quick" if args.quick else "SmolLM2-135M shapes, f32",
                "lora": LORA,
                "slots": slots,
                "prompt_tokens": prompt_len,
                "new_tokens": new,
                "repeats": args.repeats,
            },
            "rows": rows,
            "decode_ratio_unmerged_over_merged": unmerged["decode_tok_s"] / merged["decode_tok_s"],
            "step_ms_with_a_swap_per_chunk": {
                "unmerged": 1e3 * step_unmerged,
                "merged": 1e3 * step_merged,
            },
            "pick": pick,
            "load_before": load,
            "load_after": common.load_average(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
