"""Where a decode step's time goes: our sampler on the real model under the JAX profiler.

    make real-model                                        # once
    python bench/profile_decode.py                         # f32, batch 16, greedy
    python bench/profile_decode.py --batch=64 --dtype=bfloat16 --temperature=1
    python bench/profile_decode.py --quick                 # the bench model: does it run?

Not a comparison (bench_decode_real.py measures us against transformers): the diagnosis
behind its bounds. The sampler generates `--new_tokens` tokens for `--batch` random prompts
of 64 tokens (as bench_decode_real.py does), once to compile, `--repeats` times timed, then
once under the profiler with XLA's optimized HLO dumped beside the trace, so that each op
(`ynn_fusion.11`) is named by its shape and JAX source path (the LM head's dot, the staged
attention's products, the stage copies). Prints and writes (bench/results/decode_profile.json):
- wall ms a decode step (untraced median) and tokens/s;
- per program (the decode chunk, prefill): thread ms a step and busy cores on average;
- the op kinds' and the largest single ops' thread ms a step, with their labels, and the
  decode chunk's ops grouped by label (one row for a product every layer runs);
- one decode step as a timeline, from its LM head on (which ops ran alone on one core).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common, xla_trace  # noqa: E402

MODEL_DIR = common.REAL_MODEL_DIR
PROMPT_LEN = 64
DECODE = "jit__decode_chunk"


def main(argv=None) -> int:
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--chunk_steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=12, help="op kinds and single ops listed")
    p.add_argument("--quick", action="store_true", help="the bench model, 16 tokens")
    args = p.parse_args(argv)
    if min(args.batch, args.new_tokens, args.chunk_steps, args.repeats, args.top) < 1:
        print(
            "error: --batch, --new_tokens, --chunk_steps, --repeats and --top must be >= 1",
            file=sys.stderr,
        )
        return 2
    if not args.quick:
        common.require_model(MODEL_DIR)
    with tempfile.TemporaryDirectory(prefix="profile_decode_") as tmp:
        dump = Path(tmp) / "hlo"
        # Read by XLA when the backend starts: set before anything imports jax's backend.
        os.environ["XLA_FLAGS"] = " ".join(
            [os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text"]
        ).strip()
        return profile(args, Path(tmp), dump)


def profile(args, tmp: Path, dump: Path) -> int:
    import numpy as np

    from bench.bench_decode import make_checkpoint, our_sampler
    from pipelinerl_jax.sampler.sequence import SamplingParams

    new_tokens = 16 if args.quick else args.new_tokens
    chunk = min(args.chunk_steps, new_tokens)
    path = MODEL_DIR
    if args.quick:
        path = tmp / "bench_model"
        make_checkpoint(path)
    load = common.warn_if_busy()
    sampler, _ = our_sampler(path, args.dtype, args.batch, new_tokens, chunk, PROMPT_LEN)
    vocab = sampler.model_cfg.vocab_size
    prompts = list(np.random.default_rng(args.batch).integers(0, vocab, (args.batch, PROMPT_LEN)))
    how = SamplingParams(temperature=args.temperature, max_new_tokens=new_tokens)

    def generate():
        sampler.generate(prompts, params=how)

    generate()  # compiles every window bucket the run meets
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        generate()
        times.append(time.perf_counter() - t)
    wall_s = statistics.median(times)
    trace = xla_trace.capture(generate, tmp / "trace")
    events = xla_trace.op_events(trace)
    decode_labels = xla_trace.hlo_labels(dump, DECODE)
    decode_events = [e for e in events if e["module"] == DECODE]
    steps = new_tokens
    kinds = xla_trace.op_kinds(events, per=steps)[: args.top]
    # Single ops: each op its own kind. By label: the same product in every layer is one row.
    single = [
        dict(r, op=r["kind"], label=decode_labels.get(r["kind"], ""))
        for r in xla_trace.op_kinds([dict(e, kind=e["op"]) for e in decode_events], per=steps)
    ][: args.top]
    by_label = xla_trace.op_kinds(
        [dict(e, kind=decode_labels.get(e["op"], e["kind"])) for e in decode_events], per=steps
    )[: args.top]
    programs = {m: xla_trace.busy_threads(events, m) for m in sorted({e["module"] for e in events})}
    for row in programs.values():
        row["per_step_thread_ms"] = row["thread_ms"] / steps
    # One step from the middle of the run, starting at the op with the most time a step that
    # runs once a step (the LM head): its layers in order, not a chunk's stage copies.
    once = [r["op"] for r in single if round(r["count"]) == 1] or [r["op"] for r in single]
    marks = [e for e in decode_events if once and e["op"] == once[0]]
    start = marks[len(marks) // 2]["start_us"] if marks else 0.0
    step_ms = wall_s / steps * 1e3
    lines = xla_trace.timeline(events, start, step_ms * 1e3)
    result = dict(
        config=dict(
            model="bench model (--quick)" if args.quick else MODEL_DIR.name,
            batch=args.batch,
            dtype=args.dtype,
            temperature=args.temperature,
            new_tokens=new_tokens,
            chunk_steps=chunk,
            prompt_len=PROMPT_LEN,
        ),
        load=load,
        wall_ms_per_step=step_ms,
        tokens_per_s=args.batch * new_tokens / wall_s,
        programs=programs,
        op_kinds=kinds,
        decode_ops=single,
        decode_by_label=by_label,
        timeline=lines,
    )
    print(f"{step_ms:.1f} ms a decode step, {result['tokens_per_s']:.0f} tokens/s (untraced)")
    for m, row in programs.items():
        print(
            f"  {m}: {row['per_step_thread_ms']:.2f} thread ms a step, "
            f"{row['busy_threads']:.2f} cores busy on average"
        )
    common.print_table(kinds, ["module", "kind", "ms", "count", "share"])
    common.print_table(result["decode_ops"], ["op", "ms", "count", "share", "label"])
    common.print_table(by_label, ["kind", "ms", "count", "share"])
    print("\n".join(lines[:60]))
    if not args.quick:
        common.write_result("decode_profile", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
