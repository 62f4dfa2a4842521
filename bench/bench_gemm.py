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

The weight gradient x^T g contracts the token axis, the leading axis of both operands, and
XLA:CPU can run it two ways (`--forms`): `contract`, the dot contracting that axis in place (XLA
runs it itself, off YNNPACK; the f32 step's form), and `copy`, the activations first copied
physically transposed (`mixed_matmul.lhs_transposed`, the copy timed with the product) so the
dot is row-major and goes to YNNPACK (the 16-bit step's form, since XLA:CPU upcasts a 16-bit
`contract` to f32). A third form, `copy_values`, is that copy made of the 16-bit values rather
than their bits, which XLA:CPU moves through f32: the form `copy` replaced. All three are
timed for each weight-gradient shape, each row saying whether it is the form the step runs;
torch runs its strided transpose, as autograd hands it over. Each
shape is timed in alternating rounds (common.alternating_medians). Writes
bench/results/gemm.json.
"""

from __future__ import annotations

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
    ("down weight gradient [F, N] @ [N, E]", 1536, 8192, 576, True),
    ("q/o weight gradient [E, N] @ [N, E]", 576, 8192, 576, True),
    ("k/v weight gradient [E, N] @ [N, K D]", 576, 8192, 192, True),
    ("LM head forward, 1024 tokens [Nc, E] @ [E, V]", 1024, 576, 49152, False),
)
QUICK_SHAPES = (
    ("quick [64, 32] @ [32, 48]", 64, 32, 48, False),
    ("quick weight gradient [32, 64] @ [64, 48]", 32, 64, 48, True),
)
# The weight gradient's form each step dtype runs (module docstring).
STEP_FORM = {"float32": "contract", "bfloat16": "copy"}
FORMS = ("contract", "copy", "copy_values")


def pair(m: int, k: int, n: int, dtype: str, form: str | None):
    """(ours, torch) zero-argument calls computing the same [m, k] @ [k, n] product; `form`
    (a weight gradient's: "contract" or "copy") gives ours the left operand as [k, m]."""
    import jax
    import jax.numpy as jnp
    import torch

    from pipelinerl_jax.models.mixed_matmul import lhs_transposed

    rng = np.random.default_rng(m * k + n)
    a = rng.standard_normal((k, m) if form else (m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    jdt = jnp.dtype(dtype)
    ja, jb = jnp.asarray(a, jdt), jnp.asarray(b, jdt)
    f32 = jnp.float32
    if form == "contract":
        dims = (((0,), (0,)), ((), ()))
        mm = jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims, preferred_element_type=f32))
    elif form == "copy":
        mm = jax.jit(lambda x, y: jnp.matmul(lhs_transposed(x), y, preferred_element_type=f32))
    elif form == "copy_values":
        mm = jax.jit(
            lambda x, y: jnp.matmul(lhs_transposed(x, as_bits=False), y, preferred_element_type=f32)
        )
    else:
        mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=f32))
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    ta, tb = torch.from_numpy(a).to(tdt), torch.from_numpy(b).to(tdt)
    ta = ta.T if form else ta  # a strided view, as autograd hands it to the matmul
    return (lambda: mm(ja, jb).block_until_ready()), (lambda: ta @ tb)


def main(argv=None) -> int:
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--forms", default=",".join(FORMS), help="weight-gradient forms to time")
    args = ap.parse_args(argv)
    common.at_least(args.repeats, "--repeats")
    forms = args.forms.split(",")
    if not forms or set(forms) - set(FORMS):
        print(f"--forms={args.forms}: use a comma list of {', '.join(FORMS)}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(os.cpu_count())
    load = common.warn_if_busy()
    common.quick_alone(args, ap, ("repeats",))
    repeats = 2 if args.quick else args.repeats
    rows = []
    for dtype in ("float32", "bfloat16"):
        for name, m, k, n, transposed in QUICK_SHAPES if args.quick else SHAPES:
            for form in forms if transposed else (None,):
                if form == "copy_values" and dtype == "float32":
                    continue  # only a 16-bit copy has bits to move apart from its values
                ours, theirs = pair(m, k, n, dtype, form)
                med = common.alternating_medians({"ours": ours, "torch": theirs}, repeats=repeats)
                flop = 2 * m * k * n
                row = dict(shape=name, m=m, k=k, n=n, dtype=dtype)
                if form:
                    row.update(form=form, step_form=form == STEP_FORM[dtype])
                for side, (seconds, _) in med.items():
                    row[f"{side}_gflops"] = flop / seconds / 1e9
                row["ratio"] = row["ours_gflops"] / row["torch_gflops"]
                rows.append(row)
                print(row, flush=True)
    common.print_table(rows, ["dtype", "shape", "form", "ours_gflops", "torch_gflops", "ratio"])
    common.write_result(
        "gemm_quick" if args.quick else "gemm",
        {
            "config": {"quick": args.quick, "repeats": repeats, "step_form": STEP_FORM},
            "load_before": load,
            "load_after": common.load_average(),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
