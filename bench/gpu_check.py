"""One prepared check for a lent GPU machine: versions, the Triton kernel, decode, train, pipeline.

On the GPU machine (repo root as cwd, `.whl` carried; bench/gpu_bundle.sh makes it here):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:. python3 bench/gpu_check.py --out=$OUT

Here, before spending GPU time (same code path, tiny sizes, under a minute on 2 cores):

    JAX_PLATFORMS=cpu .venv/bin/python bench/gpu_check.py --cpu_rehearsal --out=/tmp/gpu_check

Stages, each with a time budget (a stage that starts past the total budget is skipped with the
reason logged; a stage that fails records its error and the next one runs):
  env          versions (jax, jaxlib, flax, jax-triton, triton, torch, ...), devices, nvidia-smi
  kernel_test  tests/test_paged_attention_gpu.py's check in its script mode: the Triton kernel
               through jax-triton against the jnp reference, max error per config
  decode       tokens/s of our sampler (bf16 params and cache, attention "paged": the Triton
               kernel on GPU) vs transformers `generate` (torch, bf16, the same weights) at
               batch 1/16/64/256 for the bench model, SmolLM2-135M and Qwen2.5-1.5B shapes
  train        train-step tokens/s and MFU (bf16 compute) of the bench model and SmolLM2 shape
  pipeline     launch.py's demo run with in-flight swaps: swap pause, lag histogram, reward
  predictions  pipelinerl_jax.plan.roofline's predictions beside every measurement
After every stage (and every decode / train row) $OUT/gpu_check.json is rewritten, so a run cut
short still returns what it measured; the log is $OUT/gpu_check.log. A watchdog writes the JSON
and exits (code 124) at --hard_limit_s. docs/gpu_check.md says what each figure means.
"""

# One idea a file (the docstring above is --help's text, so the layout is said here): this file
# the CLI, sizes, budgets and stage order; gpu_check_harness.py the JSON record, log, per-stage
# budget and watchdog; gpu_check_stages.py env, kernel_test, train and pipeline;
# gpu_check_decode.py decode; gpu_check_predict.py the roofline predictions and their stage.

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

# The repo root, so `bench.*` and `pipelinerl_jax` import however this file is started (as a
# script its own folder, bench/, is sys.path[0], not the root).
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import at_least, number_list  # noqa: E402
from bench.gpu_check_decode import stage_decode  # noqa: E402
from bench.gpu_check_harness import Check  # noqa: E402
from bench.gpu_check_predict import pick_gpu, stage_predictions  # noqa: E402
from bench.gpu_check_stages import (  # noqa: E402
    stage_env,
    stage_kernel_test,
    stage_pipeline,
    stage_train,
)

STAGES = ("env", "kernel_test", "decode", "train", "pipeline", "predictions")
# Seconds per stage on the GPU machine: 435 s in all, so the check with the wheel install ends
# inside 8 minutes. Decode gets most: 12 rows, each a compile and two engines' generate calls
# (transformers' 30-layer generate takes seconds a call at any batch: Python per layer per step).
GPU_BUDGETS = dict(env=20, kernel_test=60, decode=220, train=55, pipeline=75, predictions=5)
# Rehearsal budgets are guards, not targets: a loaded 2-core machine must still run every stage.
REHEARSAL_BUDGETS = dict(env=30, kernel_test=10, decode=60, train=45, pipeline=90, predictions=10)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each stage measures; --cpu_rehearsal shrinks every field."""

    decode_models: tuple[str, ...] = ("bench", "smollm2-135m", "qwen2.5-1.5b")
    batches: tuple[int, ...] = (1, 16, 64, 256)
    prompt_len: int = 64
    new_tokens: int = 128
    temperature: float = 1.0  # plain sampling, as RL samples (no top-k / top-p)
    repeats: int = 2  # timed generate calls per engine, alternating, after the untimed ones
    # (model, rows, seq_len, remat): rows of seq_len tokens per optimizer step
    train_models: tuple[tuple[str, int, int, bool], ...] = (
        ("bench", 32, 1024, False),
        ("smollm2-135m", 16, 1024, True),
    )
    train_prompt_len: int = 64
    train_steps: int = 5  # timed steps after the compiling one
    pipeline_steps: int = 200


REHEARSAL = Sizes(
    decode_models=("tiny",),
    batches=(1, 4),
    prompt_len=8,
    new_tokens=8,
    repeats=1,
    train_models=(("tiny", 2, 64, False),),
    train_prompt_len=16,
    train_steps=2,
    pipeline_steps=4,
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.log")
    ap.add_argument(
        "--cpu_rehearsal",
        action="store_true",
        help="tiny sizes on CPU, transformers on torch CPU, the kernel test skipped: checks "
        "that the script runs before GPU time is spent on it",
    )
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset")
    ap.add_argument("--models", default=None, help="decode models (default: the three)")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,16,64,256)")
    ap.add_argument("--pipeline_steps", type=int, default=None, help="default 200")
    ap.add_argument(
        "--lora_rank",
        type=int,
        default=0,
        help="train: also each model with rank-R LoRA adapters on all projections (0: not)",
    )
    ap.add_argument(
        "--budget_scale",
        type=float,
        default=1.0,
        help="multiplies every stage's time budget (a rerun with less device time left)",
    )
    ap.add_argument(
        "--hard_limit_s",
        type=float,
        default=None,
        help="watchdog: write the JSON and exit 124 past this (default: budget + 30 s)",
    )
    args = ap.parse_args(argv)
    if not args.out.strip():
        ap.error("--out is empty (on the GPU machine: --out=$OUT, the folder that comes back)")
    if args.batches is not None:
        number_list(args.batches, "--batches", minimum=1, example="1,16,64,256")
    at_least(args.pipeline_steps, "--pipeline_steps")
    args.stages = [s for s in args.stages.split(",") if s]
    bad = [s for s in args.stages if s not in STAGES]
    if bad:
        ap.error(f"--stages: unknown {bad}; choose from {list(STAGES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_rehearsal:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        # JAX would take 75% of the GPU at start; transformers runs in this process too.
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    sizes = REHEARSAL if args.cpu_rehearsal else Sizes()
    if args.models:
        sizes = dataclasses.replace(sizes, decode_models=tuple(args.models.split(",")))
    if args.batches:
        sizes = dataclasses.replace(sizes, batches=tuple(int(b) for b in args.batches.split(",")))
    if args.pipeline_steps:
        sizes = dataclasses.replace(sizes, pipeline_steps=args.pipeline_steps)
    base = REHEARSAL_BUDGETS if args.cpu_rehearsal else GPU_BUDGETS
    budgets = {k: v * args.budget_scale for k, v in base.items()}
    if args.hard_limit_s is None:
        args.hard_limit_s = sum(budgets[s] for s in args.stages) + 30
    check = Check(Path(args.out), args, budgets)
    check.record["sizes"] = dataclasses.asdict(sizes)
    check.start_watchdog(args.hard_limit_s)
    check.log(f"gpu_check ({check.record['mode']}): stages {args.stages}, out {args.out}")

    gpu_box = {}

    def gpu():
        # The GpuSpec of this device (env's device_kind; H100 when env did not run).
        if "gpu" not in gpu_box:
            kind = check.record["stages"].get("env", {}).get("device_kind", "")
            gpu_box["gpu"] = pick_gpu(kind)
        return gpu_box["gpu"]

    runners = {
        "env": lambda ctx: stage_env(ctx, args),
        "kernel_test": lambda ctx: stage_kernel_test(ctx, args),
        "decode": lambda ctx: stage_decode(ctx, args, sizes, gpu()),
        "train": lambda ctx: stage_train(ctx, args, sizes, gpu()),
        "pipeline": lambda ctx: stage_pipeline(ctx, args, sizes),
        "predictions": lambda ctx: stage_predictions(ctx, check, gpu()),
    }
    for name in STAGES:
        if name in args.stages:
            check.run_stage(name, runners[name])
        else:
            check.record["stages"][name] = dict(status="skipped", reason="not in --stages")
    statuses = {k: v["status"] for k, v in check.record["stages"].items()}
    check.record["statuses"] = statuses
    check.log("done: " + ", ".join(f"{k} {v}" for k, v in statuses.items()))
    check.save()
    return 0 if all(v != "failed" for v in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
