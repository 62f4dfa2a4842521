"""Where XLA:CPU runs the real model's bf16 train step: its matmuls by backend, and XLA flags.

    python bench/train_step_xla.py                     # inventory + default vs oneDNN flags
    python bench/train_step_xla.py --flag_sets=default # the inventory and one timing

The bf16 train step (SmolLM2-135M, 16 x 512 tokens, f32 params with bf16 compute, a bf16 LM
head, remat keeping matmul outputs: bench/bench_train_step.py's real-model step) is compiled
once and every dot of its optimized HLO listed: the fusion that runs it (`__ynn_fusion` is
XLA:CPU's YNNPACK path, anything else its own emitter), its operand and result dtypes, shape
and contraction, so a dot left out of the fast bf16 path shows up by name. Then the step is
timed (compile, then the median of --repeats steps) in a fresh process per XLA flag set, since
XLA_FLAGS is read once per process: XLA's default, and oneDNN for its matmuls. Writes
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

MODEL_DIR = ROOT / "models" / "SmolLM2-135M-Instruct"
FLAG_SETS = {
    "default": "",
    "onednn": "--xla_cpu_use_onednn=true",
    "ynn_dots_off": "--xla_cpu_experimental_ynn_fusion_type=-individual_dot",
}


def _inputs(model_dir: Path):
    """bench_train_step's real-model bf16 inputs (bf16 head, remat keeping matmuls)."""
    from bench import bench_train_step as bts

    args = argparse.Namespace(model_dir=str(model_dir), remat_policy="matmuls")
    return bts._real_inputs(args, "bfloat16")


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


def inventory(model_dir: Path) -> list[dict]:
    from bench import bench_train_step as bts

    trainer, state, batch = bts.jax_trainer(*_inputs(model_dir), 1024, "bfloat16")
    # Trainer._step is the jitted step train_step calls (trainer.frozen: LoRA's base, or None).
    hlo = trainer._step.lower(state, batch, trainer.frozen).compile().as_text()
    return dot_inventory(hlo)


def time_child(model_dir: Path, repeats: int) -> dict:
    from bench import bench_train_step as bts

    step = bts.jax_step(*_inputs(model_dir), 1024, "bfloat16")
    t0 = time.perf_counter()
    first_loss = step()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return dict(
        compile_s=compile_s, times=times, median_s=statistics.median(times), loss=first_loss
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", default=str(MODEL_DIR))
    p.add_argument("--flag_sets", default="default,onednn", help=f"of {sorted(FLAG_SETS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", action="store_true", help="(internal) time one flag set")
    args = p.parse_args()
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        print(f"no model at {model_dir}: run `make real-model` first", file=sys.stderr)
        return 2
    unknown = sorted(set(args.flag_sets.split(",")) - set(FLAG_SETS))
    if unknown:
        print(f"--flag_sets: unknown {unknown}; use some of {sorted(FLAG_SETS)}", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(time_child(model_dir, args.repeats)), flush=True)
        return 0
    load = common.warn_if_busy()
    dots = inventory(model_dir)
    for d in dots:
        print(d)
    timings = {}
    for name in args.flag_sets.split(","):
        cmd = [sys.executable, __file__, "--child", f"--model_dir={model_dir}"]
        cmd += [f"--repeats={args.repeats}"]
        env = dict(os.environ, XLA_FLAGS=FLAG_SETS[name])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"flag set {name} failed:\n{proc.stderr[-2000:]}")
        timings[name] = dict(
            json.loads(proc.stdout.strip().splitlines()[-1]), xla_flags=FLAG_SETS[name]
        )
        print(name, timings[name], flush=True)
    payload = dict(
        benchmark="train_step_xla",
        model=str(model_dir.name),
        step="bf16 compute, f32 params, bf16 LM head, remat keeping matmuls, 16 x 512 tokens",
        load=load,
        dots=dots,
        dots_total=sum(d["count"] for d in dots),
        dots_ynn=sum(d["count"] for d in dots if d["backend"] == "__ynn_fusion"),
        timings=timings,
    )
    print("wrote", common.write_result("train_step_xla", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
