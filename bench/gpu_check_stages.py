"""bench/gpu_check.py's other measuring stages: env, kernel_test, train and pipeline.

(`decode` is bench/gpu_check_decode.py, `predictions` bench/gpu_check_predict.py.) kernel_test
and pipeline run a child process under the stage budget (harness.run_child), so a hung child
costs its stage, not the run. JAX and the project are imported inside the stages:
`gpu_check.py --help` must work without them.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.gpu_check_harness import ROOT, Skip, Stage, fmt, free_memory, run_child
from bench.gpu_check_predict import model_config, pick_gpu, predict_train, train_flops_per_token

if TYPE_CHECKING:
    from bench.gpu_check import Sizes

KERNEL_TEST = ROOT / "tests" / "test_paged_attention_gpu.py"
VERSIONS = (
    "jax",
    "jaxlib",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "flax",
    "jax-triton",
    "triton",
    "torch",
    "transformers",
    "optax",
    "orbax-checkpoint",
    "chex",
    "tensorstore",
    "grain",
    "ml_collections",
    "numpy",
)
# Where each module was imported from: /tmp/site (the carried wheels) or the machine's own.
MODULES = ("flax", "jax_triton", "optax", "orbax.checkpoint", "chex", "grain", "ml_collections")


def stage_env(ctx: Stage, args) -> None:
    import jax

    rec = ctx.rec
    rec["python"] = platform.python_version()
    rec["executable"] = sys.executable
    rec["cpus"] = os.cpu_count()
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    rec["versions"] = versions
    paths = {}
    for mod in MODULES:
        try:
            spec = importlib.util.find_spec(mod)
            paths[mod] = spec.origin if spec else None
        except Exception as e:  # noqa: BLE001 - a parent package that fails to import
            paths[mod] = f"{type(e).__name__}: {e}"
    rec["module_origins"] = paths
    rec["backend"] = jax.default_backend()
    devices = jax.devices()
    rec["devices"] = [str(d) for d in devices]
    rec["device_kind"] = devices[0].device_kind
    rec["gpu_spec"] = pick_gpu(devices[0].device_kind).name
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "name,memory.total,driver_version,clocks.max.sm,power.limit"
        proc = subprocess.run(
            [smi, f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        rec["nvidia_smi"] = (proc.stdout or proc.stderr).strip()
    else:
        rec["nvidia_smi"] = "nvidia-smi not on PATH"
    from pipelinerl_jax.kernels import paged_attention as pa

    rec["triton_kernel_selected"] = pa.triton_available()
    for key in ("backend", "device_kind", "gpu_spec", "triton_kernel_selected", "nvidia_smi"):
        ctx.log(f"{key}: {rec[key]}")
    ctx.log("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if not args.cpu_rehearsal:
        if rec["backend"] != "gpu":
            ctx.problem(f"JAX backend is {rec['backend']!r}, not 'gpu'")
        elif not rec["triton_kernel_selected"]:
            ctx.problem("GPU backend but the Triton kernel path is not selected (jax-triton?)")


def _load_kernel_test():
    """tests/test_paged_attention_gpu.py as a module (tests/ is no package)."""
    spec = importlib.util.spec_from_file_location("test_paged_attention_gpu", KERNEL_TEST)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stage_kernel_test(ctx: Stage, args) -> None:
    mod = _load_kernel_test()
    missing = mod._gpu_stack_missing()
    ctx.rec["stack_missing"] = missing
    ctx.rec["configs_expected"] = len(mod.CONFIGS)
    if args.cpu_rehearsal:
        raise Skip(
            "cpu rehearsal: the Triton kernel needs an NVIDIA GPU"
            + (f" (this machine lacks {', '.join(missing)})" if missing else "")
        )
    if missing:
        ctx.problem(f"GPU stack incomplete: {', '.join(missing)}")
    # The test file's script mode, as the gpu-marked test runs it (its own process, CUDA
    # platform); preallocation off: this process already holds part of the GPU's memory.
    env = dict(
        os.environ,
        JAX_PLATFORMS="cuda",
        TRITON_DEFAULT_FP_FUSION="1",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kernel.json"
        proc = run_child(
            ctx, [sys.executable, str(KERNEL_TEST), str(out)], env, timeout=max(5, ctx.left())
        )
        ctx.rec["returncode"] = proc["returncode"]
        if proc["returncode"] != 0 or not out.exists():
            ctx.rec["stderr_tail"] = proc["tail"]
            raise RuntimeError(f"kernel check exited {proc['returncode']}: {proc['tail'][-300:]}")
        results = json.loads(out.read_text())
    configs, passed = {}, True
    for name, res in results.items():
        tol = mod.TOLERANCE[res["dtype"]]
        ok = bool(res["zero_len_zeros"]) and res["max_err"] <= tol
        configs[name] = dict(res, tolerance=tol, passed=ok)
        passed &= ok
        ctx.log(f"{name}: max_err {res['max_err']:.3g} (tolerance {tol}) {'ok' if ok else 'FAIL'}")
    ctx.rec["configs"] = configs
    ctx.rec["passed"] = passed and len(results) == len(mod.CONFIGS)
    if not ctx.rec["passed"]:
        ctx.problem("the Triton kernel does not match the reference within tolerance")


def stage_train(ctx: Stage, args, sizes: Sizes, gpu) -> None:
    import jax

    from bench import bench_train_step as bts
    from bench import common
    from pipelinerl_jax.models import decoder

    rows = ctx.rec.setdefault("rows", [])
    ctx.rec["config"] = dict(
        objective="tis_reinforce",
        optimizer="adamw",
        dtypes="f32 params (master weights), bf16 compute, bf16 LM head operands (each row's "
        "head_dtype says if it fell back to f32)",
        peak=f"{gpu.name} bf16 {gpu.bf16_flops:.3g} FLOP/s",
        flops_per_token="6 x matmul params per token + 6 L H D seq_len (causal attention)",
        timed_steps=sizes.train_steps,
    )
    # With --lora_rank each model also trains rank-R adapters (all projections, alpha 2R) on
    # its frozen base; its MFU keeps the 6 x params convention, though LoRA skips the base's
    # weight gradients (about 4 x params of useful work), so compare its tok/s, not its MFU.
    lora_cfgs = [None]
    if getattr(args, "lora_rank", 0):
        lora_cfgs.append({"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank})
    runs = [(*m, lora_cfg) for m in sizes.train_models for lora_cfg in lora_cfgs]
    for name, num_rows, seq_len, remat, lora_cfg in runs:
        if ctx.left() <= 0:
            ctx.rec.setdefault("skipped", []).append(dict(model=name, reason="budget spent"))
            continue
        row = dict(model=name, rows=num_rows, seq_len=seq_len, remat=remat)
        if lora_cfg is not None:
            row["lora"] = lora_cfg
        tokens = num_rows * seq_len
        row["tokens"] = tokens
        cfg = model_config(
            name,
            args.cpu_rehearsal,
            param_dtype="float32",
            compute_dtype="bfloat16",
            remat=remat,
            remat_policy="matmuls",
        )
        if lora_cfg is not None:
            cfg = dataclasses.replace(cfg, lora=lora_cfg)
        try:
            _, params = decoder.init(cfg, jax.random.key(0))
            batch = bts.make_batch(cfg, num_rows, seq_len, min(sizes.train_prompt_len, seq_len))
            row["head_dtype"] = "bfloat16"
            step = bts.jax_step(cfg, params, batch, token_chunk=1024, head_dtype="bfloat16")
            t = time.perf_counter()
            try:
                row["first_loss"] = step()  # compiles
            except Exception as e:  # noqa: BLE001
                # XLA:CPU (jax 0.10 and 0.11) fails a tied LM head on bf16 operands with
                # "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"; should a
                # backend refuse it, the row is still measured with the project's default head.
                if "BF16" not in str(e).upper():
                    raise
                row["head_dtype"] = f"float32 (bfloat16 failed: {str(e)[:200]})"
                ctx.log(f"{name}: bf16 LM head failed; measuring with an f32 head")
                step = bts.jax_step(cfg, params, batch, token_chunk=1024, head_dtype="float32")
                t = time.perf_counter()
                row["first_loss"] = step()
            row["compile_s"] = time.perf_counter() - t
            step_s, times = common.median_time(step, repeats=sizes.train_steps, warmup=0)
            row.update(step_s=step_s, times=times, tok_s=tokens / step_s)
            row["flops_per_token"] = train_flops_per_token(cfg, seq_len)
            row["mfu"] = row["flops_per_token"] * row["tok_s"] / gpu.bf16_flops
            del step, params, batch
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
            ctx.problem(f"train {name}: {row['error'][:300]}")
        row["predicted"] = predict_train(cfg, gpu, tokens=tokens, seq_len=seq_len, remat=remat)
        if "tok_s" in row["predicted"]:
            row["predicted"]["mfu"] = (
                train_flops_per_token(cfg, seq_len) * row["predicted"]["tok_s"] / gpu.bf16_flops
            )
            if "tok_s" in row:
                row["frac_of_predicted"] = row["tok_s"] / row["predicted"]["tok_s"]
        rows.append(row)
        label = f"{name} lora r{lora_cfg['rank']}" if lora_cfg else name
        ctx.log(
            f"{label} {num_rows}x{seq_len}: {fmt(row.get('tok_s'))} tok/s, MFU {fmt(row.get('mfu'))}"
            f", predicted {fmt(row['predicted'].get('tok_s'))} tok/s"
        )
        ctx.save()
        free_memory()


def stage_pipeline(ctx: Stage, args, sizes: Sizes) -> None:
    """launch.py's demo config (pipeline mode, in-flight swaps) for sizes.pipeline_steps steps,
    interrupted at the stage budget; figures come from its metrics.jsonl, so an interrupted run
    still reports the steps it made."""
    steps = sizes.pipeline_steps
    flags = [
        "--config=configs/default.py",
        f"--config.steps={steps}",
        "--config.log_every=0",
        "--config.eval_every=0",
        "--config.checkpoint_every=0",
    ]
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",  # this process holds part of the GPU already
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    ctx.rec["config"] = dict(preset="demo", steps_goal=steps, flags=flags)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp) / "run"
        cmd = [sys.executable, str(ROOT / "launch.py"), *flags, f"--workdir={workdir}"]
        proc = run_child(ctx, cmd, env, timeout=max(5, ctx.left()))
        ctx.rec["returncode"] = proc["returncode"]
        ctx.rec["stopped"] = proc["stopped"]
        metrics = workdir / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if lines:
            shutil.copyfile(metrics, ctx.check.out / "pipeline_metrics.jsonl")
    records = [json.loads(line) for line in lines]
    train = [r for r in records if r.get("kind") == "train"]
    summary = next((r for r in records if r.get("kind") == "summary"), None)
    if not train:
        ctx.rec["output_tail"] = proc["tail"]
        raise RuntimeError(f"no train step recorded (exit {proc['returncode']})")
    rewards = [r["reward/mean"] for r in train]
    tenth = max(1, math.ceil(len(rewards) / 10))
    hist: dict[str, int] = {}
    for r in train:
        for k, v in r.get("lag/hist", {}).items():
            hist[k] = hist.get(k, 0) + v
    last = train[-1]
    ctx.rec.update(
        steps_done=len(train),
        finished=summary is not None,
        wall_s=last.get("time"),
        reward_start=sum(rewards[:tenth]) / tenth,  # first tenth of the steps
        reward_end=sum(rewards[-tenth:]) / tenth,  # last tenth
        # The summary counts every swap; the last step's record those before it was written.
        swaps=(summary or {}).get("sampler/swaps", last.get("sampler/swaps")),
        swap_pause_ms_mean=(summary or {}).get(
            "sampler/swap_pause_ms_mean", last.get("sampler/swap_pause_ms")
        ),
        lag_hist=hist,
        lag_max=max(r.get("lag/token_max", 0) for r in train),
        lag_bound=last.get("lag/bound"),
        sampler_busy_frac=last.get("sampler/busy_frac"),
        trainer_busy_frac=last.get("trainer/busy_frac"),
        samples_per_s=last.get("samples_per_s"),
        reward_curve=[(r["step"], round(r["reward/mean"], 4)) for r in train][
            :: max(1, tenth // 2)
        ],
    )
    ctx.rec["reward_rising"] = ctx.rec["reward_end"] > ctx.rec["reward_start"]
    if summary is not None:
        ctx.rec["summary"] = {k: v for k, v in summary.items() if k != "kind"}
    ctx.log(
        f"{len(train)}/{steps} steps, reward {ctx.rec['reward_start']:.3f} -> "
        f"{ctx.rec['reward_end']:.3f}, swaps {ctx.rec['swaps']} (mean pause "
        f"{fmt(ctx.rec['swap_pause_ms_mean'])} ms), lag max {ctx.rec['lag_max']}, lag histogram "
        + " ".join(f"{k}:{v}" for k, v in hist.items() if v)
    )
    if proc["returncode"] not in (0, None) and proc["stopped"] is None:
        ctx.problem(f"launch.py exited {proc['returncode']}")
