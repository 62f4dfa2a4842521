"""Decode throughput on the real model, SmolLM2-135M-Instruct, against transformers `generate`.

    make real-model                                   # the weights, once
    .venv/bin/python bench/bench_decode_real.py       # the timed run (machine must be idle)
    .venv/bin/python bench/bench_decode_real.py --quick

Both engines load the same safetensors directory. Prompts of 64 random tokens, 256 forced new
tokens (no EOS on either side), batch 1 / 8 / 16 / 64, f32 and bf16 (ours: bf16 params and
compute; transformers: the model loaded in torch.bfloat16), greedy and plain temperature-1
sampling (no top-k / top-p, as RL samples). The bf16 rows run our LM head in bf16 with f32
accumulation as transformers bf16 runs its head in bf16 (`--bf16_head_dtype=float32` for an f32
head: sampler.head_dtype). Tokens/s = generated tokens / wall time of the
whole generate call, prefill included; medians of repeats timed in alternating rounds
(bench/common.alternating_medians) and their ratio. Greedy f32 rows at batch <= 8 also report
the fraction of sequences whose tokens equal transformers' exactly. The goals (#16): >= 2.5x
transformers at every batch in f32, >= 1.5x transformers bf16 in bf16.

Writes bench/results/decode_real.json (and this machine kind's by_machine copy) after every
row (bench/row_results.py), `complete: false` until all 16 are there. A run keeps the rows of
an earlier run under the same config that it does not measure itself, so
`--batches=1 --dtypes=bfloat16` re-measures those 2 rows alone, and `--resume` measures only
the rows this kind's file lacks (how bench/machine_pass.py finishes a partial one). Each row
records its repeat count: rows near a goal can be re-measured with more (`--repeats=5`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipelinerl_jax.models import config_json, param_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common, row_results  # noqa: E402
from bench.bench_decode import bench_pair  # noqa: E402

MODEL_DIR = common.REAL_MODEL_DIR
PROMPT_LEN = 64
GOALS = {"float32": 2.5, "bfloat16": 1.5}
DEFAULT_BATCHES = (1, 8, 16, 64)
DEFAULT_DTYPES = ("float32", "bfloat16")
DEFAULT_TEMPERATURES = (0.0, 1.0)
KEY_FIELDS = ("dtype", "temperature", "batch", "head_dtype")  # a row's identity across runs


def _listed(text: str, kind, flag: str, example: str, allowed=None) -> list:
    """A comma-separated flag's values, or ValueError naming the flag and a valid example."""
    try:
        values = [kind(v) for v in text.split(",")]
        if kind is int and min(values) < 1:
            values = []
    except ValueError:
        values = []
    if not values or (allowed is not None and not set(values) <= set(allowed)):
        raise ValueError(f"{flag}={text!r} is not a comma-separated list like {example}")
    return values


def _rows_carry_repeats(previous: dict | None) -> dict | None:
    """A result from before rows were written one by one had its repeat count in its config;
    each row carries its own now (a row re-measured with more repeats joins the others)."""
    if previous and "repeats" in previous.get("config", {}):
        config = dict(previous["config"])
        repeats = config.pop("repeats")
        rows = [{"repeats": repeats, **r} for r in previous.get("rows", [])]
        previous = {**previous, "config": config, "rows": rows}
    return previous


def main(argv=None) -> int:
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: checks that it runs")
    ap.add_argument("--model", default=str(MODEL_DIR), help="a Llama-family HF directory")
    ap.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    ap.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES))
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="measure only the rows this machine kind's result lacks (same config)",
    )
    ap.add_argument("--new_tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunk_steps", type=int, default=16)
    ap.add_argument(
        "--bf16_head_dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="our LM head's operands in the bf16 rows (transformers bf16 runs its head in bf16)",
    )
    args = ap.parse_args(argv)
    common.quick_alone(args, ap, ("batches", "new_tokens", "repeats", "chunk_steps"))
    try:
        batches = [1, 8] if args.quick else _listed(args.batches, int, "--batches", "1,8")
        dtypes = _listed(args.dtypes, str, "--dtypes", "float32,bfloat16", GOALS)
        temps = _listed(args.temperatures, float, "--temperatures", "0,1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"error: --repeats={args.repeats}: give 1 or more", file=sys.stderr)
        return 2
    common.at_least(args.new_tokens, "--new_tokens")
    common.at_least(args.chunk_steps, "--chunk_steps")
    path = common.require_model(args.model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    new_tokens = 16 if args.quick else args.new_tokens
    repeats = 1 if args.quick else args.repeats
    chunk = 4 if args.quick else min(args.chunk_steps, new_tokens)

    load = common.warn_if_busy()
    from pipelinerl_jax.models import hf_io

    model_cfg = config_json.from_hf(hf_io.read_config(path))
    flop_per_token = 2 * param_counts.matmul_params_per_token(model_cfg)
    gflops = common.f32_matmul_gflops(n=1024 if args.quick else 2048)
    config = {
        "model": path.name,
        "prompt_len": PROMPT_LEN,
        "new_tokens": new_tokens,
        "chunk_steps": chunk,
        "quick": args.quick,
    }
    name = "decode_real_quick" if args.quick else "decode_real"

    def head_of(dtype: str) -> str:
        return args.bf16_head_dtype if dtype == "bfloat16" else "float32"

    def grid(dtypes_, temps_, batches_) -> list[tuple]:
        return [(d, t, b, head_of(d)) for d in dtypes_ for t in temps_ for b in batches_]

    full = grid(DEFAULT_DTYPES, DEFAULT_TEMPERATURES, DEFAULT_BATCHES)
    result = row_results.RowResult(
        name,
        config,
        KEY_FIELDS,
        grid(dtypes, temps, batches) if args.quick else full,
        previous=_rows_carry_repeats(row_results.kind_result(name)),
    )
    todo = result.to_measure(grid(dtypes, temps, batches), resume=args.resume)
    print(f"{len(todo)} rows to measure; {len(result.rows)} carried from earlier runs", flush=True)
    extra = {"cpu": common.cpu_features(), "f32_matmul_gflops": gflops}
    extra["flop_per_token"] = flop_per_token
    for dtype, temperature, batch, head_dtype in todo:
        row, _, _ = bench_pair(
            path,
            dtype,
            batch,
            new_tokens,
            repeats,
            chunk,
            check_parity=dtype == "float32" and temperature == 0 and batch <= 8,
            temperature=temperature,
            prompt_len=PROMPT_LEN,
            vocab_size=vocab,
            head_dtype=head_dtype,
        )
        row["goal"] = GOALS.get(dtype)
        row["head_dtype"] = head_dtype
        row["repeats"] = repeats
        # What bounds a batch: the rate as a fraction of this machine's f32 matmul rate
        # (2 x matmul params FLOPs per token; attention not counted).
        for side in ("ours", "hf"):
            rate = row[f"{side}_tok_s"] * flop_per_token / (gflops * 1e9)
            row[f"{side}_frac_f32_matmul_peak"] = rate
        print(row, flush=True)
        result.add(row, {"load_before": load, "load_after": common.load_average(), **extra})
    rows = result.ordered()
    common.print_table(
        rows,
        [
            "batch",
            "dtype",
            "temperature",
            "ours_tok_s",
            "hf_tok_s",
            "ratio",
            "ours_frac_f32_matmul_peak",
            "same_tokens_frac",
        ],
    )
    if not todo:
        print(f"nothing to measure: {name}'s rows for this grid are all here (drop --resume)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
