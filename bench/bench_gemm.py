"""The train step's matmuls alone: XLA's rate against torch's on the same shapes and dtypes.

    .venv/bin/python bench/bench_gemm.py          # the timed run (machine must be idle)
    .venv/bin/python bench/bench_gemm.py --quick  # a small check that everything runs

Why this exists: a train step at real sizes is mostly matmuls, so the matmul library's rate
bounds the step. This measures the rate each engine reaches on the shapes of a SmolLM2-135M
train step at 16 x 512 tokens (N = 8192; E = 576, F = 1536, the LM head's V = 49152 in chunks
of 1024 tokens), forward and both gradient products:

- f32: XLA's f32 dot (YNNPACK on CPU) against torch's `@` (oneDNN / MKL);
- bf16: operands in bf16 with f32 accumulation, as `models/mixed_matmul.py` runs them (XLA's
  fast path, AMX on a Xeon), against torch's bf16 `@` (autocast's form).

The weight gradient x^T g contracts the token axis; ours runs it on a physically transposed
copy of the activations as the trainer does (`mixed_matmul.lhs_transposed`; the copy is not
timed), torch on its strided transpose. Each shape is timed in alternating rounds
(common.alternating_medians). Writes bench/results/gemm.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402

# (name, M, K, N, whether the left operand is the transposed activations x^T)
SHAPES = (
    ("gate/up forward [N, E] @ [E, F]", 8192, 576, 1536, False),
    ("down forward [N, F] @ [F, E]", 8192, 1536, 576, False),
    ("q/o forward [N, E] @ [E, E]", 8192, 576, 576, False),
    ("gate/up weight gradient [E, N] @ [N, F]", 576, 8192, 1536, True),
    ("LM head forward, 1024 tokens [Nc, E] @ [E, V]", 1024, 576, 49152, False),
)
QUICK_SHAPES = (("quick [64, 32] @ [32, 48]", 64, 32, 48, False),)


def pair(m: int, k: int, n: int, dtype: str, transposed: bool):
    """(ours, torch) zero-argument calls computing the same [m, k] @ [k, n] product."""
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(m * k + n)
    a = rng.standard_normal((k, m) if transposed else (m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    jdt = jnp.dtype(dtype)
    ja, jb = jnp.asarray(a, jdt), jnp.asarray(b, jdt)
    if transposed:
        from pipelinerl_jax.models.mixed_matmul import lhs_transposed

        ja = jax.block_until_ready(jax.jit(lhs_transposed)(ja))  # [m, k], a real copy
    mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    ta, tb = torch.from_numpy(a).to(tdt), torch.from_numpy(b).to(tdt)
    ta = ta.T if transposed else ta  # a strided view, as autograd hands it to the matmul
    return (lambda: mm(ja, jb).block_until_ready()), (lambda: ta @ tb)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count())
    load = common.warn_if_busy()
    repeats = 2 if args.quick else args.repeats
    rows = []
    for dtype in ("float32", "bfloat16"):
        for name, m, k, n, transposed in QUICK_SHAPES if args.quick else SHAPES:
            ours, theirs = pair(m, k, n, dtype, transposed)
            med = common.alternating_medians({"ours": ours, "torch": theirs}, repeats=repeats)
            flop = 2 * m * k * n
            row = dict(shape=name, m=m, k=k, n=n, dtype=dtype)
            for side, (seconds, _) in med.items():
                row[f"{side}_gflops"] = flop / seconds / 1e9
            row["ratio"] = row["ours_gflops"] / row["torch_gflops"]
            rows.append(row)
            print(row, flush=True)
    common.print_table(rows, ["dtype", "shape", "ours_gflops", "torch_gflops", "ratio"])
    common.write_result(
        "gemm_quick" if args.quick else "gemm",
        {
            "config": {"quick": args.quick, "repeats": repeats},
            "load_before": load,
            "load_after": common.load_average(),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
