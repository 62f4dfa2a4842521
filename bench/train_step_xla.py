"""Where XLA:CPU runs the real model's train step: its matmuls by backend, and XLA flag sets.

    python bench/train_step_xla.py             # f32, bf16: default, oneDNN, YNN dots off, torch
    python bench/train_step_xla.py --dtypes=float32 --sides=default,ynn_dots_off,torch

The train step (SmolLM2-135M, 16 x 512 tokens, f32 params with `dtype` compute, a bf16 LM
head in bf16, remat keeping matmul outputs: bench/bench_train_step.py's real-model step) is
compiled and timed (compile, a warm-up, then the median of --repeats steps) in a fresh process
per XLA flag set, since XLA_FLAGS is read once per process, and torch's step (gradient
checkpointing, autocast in bf16) in a process of its own, on the same inputs. Each XLA side
also lists every dot of its optimized HLO: the fusion that runs it (`__ynn_fusion` is XLA:CPU's
YNNPACK path; none, its own emitter and Eigen), operand and result dtypes, shape and
contraction, so a dot left out of a fast path shows up by name. The flag sets: XLA's default;
oneDNN for its matmuls; YNNPACK's individual dots off, so XLA runs them itself. Writes
bench/results/train_step_xla.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

MODEL_DIR = common.REAL_MODEL_DIR
FLAG_SETS = {
    "default": "",
    "onednn": "--xla_cpu_use_onednn=true",
    "ynn_dots_off": "--xla_cpu_experimental_ynn_fusion_type=-individual_dot",
}
SIDES = (*FLAG_SETS, "torch")


def _inputs(model_dir: Path, dtype: str):
    """bench_train_step's real-model inputs in `dtype` compute (remat keeping matmuls)."""
    from bench import bench_train_step as bts

    args = argparse.Namespace(model_dir=str(model_dir), remat_policy="matmuls")
    return bts._real_inputs(args, dtype)


def _head(dtype: str) -> str:
    return "bfloat16" if dtype == "bfloat16" else "float32"


def dot_inventory(hlo: str) -> list[dict]:
    """Every dot of an optimized HLO module: the fusion kind that calls its computation, operand
    dtypes, result dtype and shape, contracting dims; counted by those keys."""
    caller, types, found, comp = {}, {}, [], None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            comp = re.match(r"^(?:ENTRY )?%?([\w.\-]+)", line).group(1)
            continue
        s = line.strip()
        m = re.match(r"(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]", s)
        if m:
            types[(comp, m.group(1))] = m.group(2)
        if " fusion(" in s:
            called = re.search(r"calls=%([\w.\-]+)", s).group(1)
            config = re.search(r'"fusion_config":\{"kind":"(\w+)"', s)
            caller[called] = config.group(1) if config else re.search(r"kind=(k\w+)", s).group(1)
        if m and " dot(" in s:
            found.append((comp, m, s))
    # A fused computation is printed before the fusion that calls it: callers are known only
    # after the whole module is read.
    dots = []
    for comp, m, s in found:
        lhs, rhs = re.search(r"dot\(%([\w.\-]+), %([\w.\-]+)\)", s).groups()
        contract = [
            re.search(rf"{side}_contracting_dims=\{{([\d,]*)\}}", s).group(1)
            for side in ("lhs", "rhs")
        ]
        dots.append(
            (
                caller.get(comp, f"unfused ({comp})"),
                f"{types.get((comp, lhs), '?')} x {types.get((comp, rhs), '?')}",
                f"{m.group(2)}[{m.group(3)}]",
                f"contracts {{{contract[0]}}} x {{{contract[1]}}}"
                + (" batched" if "lhs_batch" in s else ""),
            )
        )
    counted = collections.Counter(dots)
    return [
        dict(backend=k[0], operands=k[1], result=k[2], contraction=k[3], count=n)
        for k, n in sorted(counted.items(), key=lambda kv: (kv[0][0], -kv[1]))
    ]


def inventory(inputs, dtype: str) -> list[dict]:
    """The dots of the train step as this process's XLA flags compile it."""
    from bench import bench_train_step as bts

    trainer, state, batch = bts.jax_trainer(*inputs, 1024, _head(dtype))
    hlo = trainer.lower(state, batch).compile().as_text()
    return dot_inventory(hlo)


def time_child(model_dir: Path, dtype: str, side: str, repeats: int) -> dict:
    """One side's step in `dtype`: compile (or torch's first step), a warm-up, `repeats` timed."""
    import jax
    import torch

    from bench import bench_train_step as bts

    torch.set_num_threads(os.cpu_count())
    inputs = _inputs(model_dir, dtype)
    out = {}
    if side == "torch":
        step = bts.torch_step(*inputs, autocast=dtype == "bfloat16", checkpointing=True)
    else:
        # A cache of this child's own: the timed step reuses the inventory's compile.
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="xla_cache_"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        dots = inventory(inputs, dtype)
        out.update(
            dots=dots,
            dots_total=sum(d["count"] for d in dots),
            dots_ynn=sum(d["count"] for d in dots if d["backend"] == "__ynn_fusion"),
        )
        step = bts.jax_step(*inputs, 1024, _head(dtype))
    t0 = time.perf_counter()
    first_loss = step()
    compile_s = time.perf_counter() - t0
    step()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return dict(
        out, compile_s=compile_s, times=times, median_s=statistics.median(times), loss=first_loss
    )


def main(argv=None) -> int:
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", default=str(MODEL_DIR))
    p.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes, in turn")
    p.add_argument("--sides", default=",".join(SIDES), help=f"of {list(SIDES)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", default=None, help="(internal) time one side: DTYPE:SIDE")
    args = p.parse_args(argv)
    common.at_least(args.repeats, "--repeats")
    model_dir = common.require_model(args.model_dir)
    sides, dtypes = args.sides.split(","), args.dtypes.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        print(f"--sides: unknown {unknown}; use some of {list(SIDES)}", file=sys.stderr)
        return 2
    unknown = sorted(set(dtypes) - {"float32", "bfloat16"})
    if unknown:
        print(f"--dtypes: unknown {unknown}; use float32 and/or bfloat16", file=sys.stderr)
        return 2
    if args.child:
        dtype, side = args.child.split(":")
        print(json.dumps(time_child(model_dir, dtype, side, args.repeats)), flush=True)
        return 0
    load = common.warn_if_busy()
    rows = []
    for dtype in dtypes:
        for side in sides:
            cmd = [sys.executable, __file__, f"--child={dtype}:{side}"]
            cmd += [f"--model_dir={model_dir}", f"--repeats={args.repeats}"]
            env = dict(os.environ, XLA_FLAGS=FLAG_SETS.get(side, ""))
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"{dtype} {side} failed:\n{proc.stderr[-2000:]}")
            row = dict(dtype=dtype, side=side, **json.loads(proc.stdout.strip().splitlines()[-1]))
            if side in FLAG_SETS:
                row["xla_flags"] = FLAG_SETS[side]
            rows.append(row)
            print({k: v for k, v in row.items() if k != "dots"}, flush=True)
    payload = dict(
        benchmark="train_step_xla",
        model=str(model_dir.name),
        step="f32 params, `dtype` compute (a bf16 LM head in bf16), remat keeping matmuls, "
        "16 x 512 tokens; torch: gradient checkpointing, autocast in bf16",
        load=load,
        repeats=args.repeats,
        rows=rows,
    )
    print("wrote", common.write_result("train_step_xla", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
