"""One decode token's matmuls at batch 1, SmolLM2-135M shapes, in every form XLA:CPU offers.

    .venv/bin/python bench/bench_matvec_forms.py          # the timed run (machine must be idle)
    .venv/bin/python bench/bench_matvec_forms.py --quick  # a small check that everything runs

Why this exists: bf16 decode at batch 1 is bound by its matrix-vector products, and on a CPU
without AMX (the EPYC) XLA:CPU ran them slower than f32 ones although they read half the
bytes. This measures each way of writing the product, so the bound stands on what was tried.
A "token" is what one decode step multiplies: 30 layers of q, k, v, o, gate, up, down (each
layer its own weights, 106M parameters, streamed as a real step streams them) and the
[49152, 576] LM head, each product feeding the next layer as in the model. Forms (weights as
the sampler lays them out, output-major [O, I], x [I, N]):

- `two_columns`: the sampler's form for one 16-bit token on a CPU with AMX
  (models/block.one_16bit_token): the vector as two identical columns, bf16 operands, f32
  accumulation;
- `multiply_reduce`: its form without AMX: an elementwise product and an f32 sum over I,
  which XLA:CPU fuses with the weights' conversion (the sampler's exact function);
- `vector`: the plain [O, I] x [I, 1] product with f32 accumulation;
- `bf16_result`: the same with a bf16 result;
- `input_major`: [1, I] x [I, O] on weights stored input-major (as TokenMajor runs);
- `both_minor`: [1, I] . [O, I] contracting both minor dimensions;
- `f32_upcast`: the weights converted to f32 in the program, then the f32 product;
- `f32_weights`: f32 weights (twice the bytes): the rate the bf16 forms are measured against.

torch's F.linear on the same weights (token-major, as transformers runs it), bf16 and f32, is
the peer. Reports ms per token and the weight read rate; every form's output is checked
against numpy's arithmetic on the same (bf16-rounded) weights. Writes
bench/results/matvec_forms.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402

# SmolLM2-135M: hidden 576, MLP 1536, 3 kv heads x 64, vocabulary 49152, 30 layers.
E, F, KV, V, LAYERS = 576, 1536, 192, 49152, 30
PROJ = (("q", E, E), ("k", KV, E), ("v", KV, E), ("o", E, E), ("gate", F, E), ("up", F, E))
PROJ += (("down", E, F),)
BF16_FORMS = (
    "two_columns",
    "vector",
    "bf16_result",
    "input_major",
    "both_minor",
    "multiply_reduce",
    "f32_upcast",
)


def weights(layers: int, vocab: int, seed: int = 0) -> dict:
    """Random f32 weights [O, I] per layer and projection, and the head [V, E]."""
    rng = np.random.default_rng(seed)
    scale = lambda i: 1.0 / np.sqrt(i)  # noqa: E731
    out = {
        "layers": [
            {n: rng.standard_normal((o, i), dtype=np.float32) * scale(i) for n, o, i in PROJ}
            for _ in range(layers)
        ],
        "head": rng.standard_normal((vocab, E), dtype=np.float32) * scale(E),
    }
    return out


def product(form: str):
    """(w, x_Ix1) -> f32 [O, 1] in `form`; w as `layout(form)` stores it."""
    import jax
    import jax.numpy as jnp

    from pipelinerl_jax.models import block

    f32 = jnp.float32

    def multiply_reduce(w, x):
        return block.one_16bit_token(w, x, amx=False)

    def two_columns(w, x):
        return block.one_16bit_token(w, x, amx=True)

    forms = {
        "two_columns": two_columns,
        "vector": lambda w, x: jnp.matmul(w, x, preferred_element_type=f32),
        "bf16_result": lambda w, x: jnp.matmul(w, x).astype(f32),
        "input_major": lambda w, x: jnp.matmul(x.T, w, preferred_element_type=f32).T,
        "both_minor": lambda w, x: (
            jax.lax.dot_general(x.T, w, (((1,), (1,)), ((), ())), preferred_element_type=f32).T
        ),
        "multiply_reduce": multiply_reduce,
        "f32_upcast": lambda w, x: jnp.matmul(w.astype(f32), x.astype(f32)),
        "f32_weights": lambda w, x: jnp.matmul(w, x, preferred_element_type=f32),
    }
    return forms[form]


def stored(form: str, w_OxI: np.ndarray):
    import jax.numpy as jnp

    dtype = jnp.float32 if form == "f32_weights" else jnp.bfloat16
    return jnp.asarray(w_OxI.T.copy() if form == "input_major" else w_OxI, dtype)


def token_fn(form: str):
    """Jitted: one token through every layer's projections and the head, as the model chains
    them (residual adds, a normalisation per layer so values stay in range)."""
    import jax
    import jax.numpy as jnp

    mm = product(form)
    f32 = jnp.float32

    @jax.jit
    def run(layers, head, h_Ex1):
        dtype = head.dtype
        for lp in layers:
            x = h_Ex1.astype(dtype)
            q, k, v = mm(lp["q"], x), mm(lp["k"], x), mm(lp["v"], x)
            o = mm(lp["o"], q.astype(dtype))
            act = jax.nn.silu(mm(lp["gate"], x)) * mm(lp["up"], x)
            d = mm(lp["down"], act.astype(dtype))
            h = h_Ex1 + o + d + jnp.mean(k) + jnp.mean(v)
            h_Ex1 = h * jax.lax.rsqrt(jnp.mean(h * h) + 1e-6)
        return mm(head, h_Ex1.astype(dtype)).astype(f32)

    return run


def reference(w: dict, h_Ex1: np.ndarray, *, bf16: bool) -> np.ndarray:
    """numpy's f32 arithmetic of `token_fn` (weights and inputs rounded to bf16 when `bf16`)."""
    import ml_dtypes

    r = (lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)) if bf16 else (lambda a: a)
    silu = lambda a: a / (1.0 + np.exp(-a))  # noqa: E731
    for lp in w["layers"]:
        x = r(h_Ex1)
        q, k, v = r(lp["q"]) @ x, r(lp["k"]) @ x, r(lp["v"]) @ x
        o = r(lp["o"]) @ r(q)
        d = r(lp["down"]) @ r(silu(r(lp["gate"]) @ x) * (r(lp["up"]) @ x))
        h = h_Ex1 + o + d + k.mean() + v.mean()
        h_Ex1 = h / np.sqrt(np.mean(h * h) + 1e-6)
    return r(w["head"]) @ r(h_Ex1)


def torch_fn(w: dict, dtype: str):
    """The same token in torch: F.linear on [1, I] rows (token-major, as transformers)."""
    import torch
    import torch.nn.functional as nnf

    tdtype = getattr(torch, dtype)
    layers = [{n: torch.from_numpy(a).to(tdtype) for n, a in lp.items()} for lp in w["layers"]]
    head = torch.from_numpy(w["head"]).to(tdtype)

    def run(h_1xE):
        with torch.inference_mode():
            h = torch.from_numpy(h_1xE)
            for lp in layers:
                x = h.to(tdtype)
                q, k, v = nnf.linear(x, lp["q"]), nnf.linear(x, lp["k"]), nnf.linear(x, lp["v"])
                o = nnf.linear(q, lp["o"])
                d = nnf.linear(
                    nnf.silu(nnf.linear(x, lp["gate"])) * nnf.linear(x, lp["up"]), lp["down"]
                )
                h = h + o.float() + d.float() + k.float().mean() + v.float().mean()
                h = h * torch.rsqrt(torch.mean(h * h) + 1e-6)
            return nnf.linear(h.to(tdtype), head).float().numpy()

    return run


def main() -> int:
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, a small head: checks it runs")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if args.repeats < 1:
        print(f"error: --repeats={args.repeats}: give 1 or more", file=sys.stderr)
        return 2
    import jax.numpy as jnp
    import torch

    torch.set_num_threads(os.cpu_count())
    load = common.warn_if_busy()
    layers, vocab = (2, 4096) if args.quick else (LAYERS, V)
    repeats = 2 if args.quick else args.repeats
    w = weights(layers, vocab)
    params = layers * sum(o * i for _, o, i in PROJ) + vocab * E
    rng = np.random.default_rng(1)
    h_Ex1 = rng.standard_normal((E, 1), dtype=np.float32)
    expected = {
        "bfloat16": reference(w, h_Ex1, bf16=True),
        "float32": reference(w, h_Ex1, bf16=False),
    }
    fns, outputs, bytes_per = {}, {}, {}
    for form in (*BF16_FORMS, "f32_weights"):
        run = token_fn(form)
        lw = [{n: stored(form, a) for n, a in lp.items()} for lp in w["layers"]]
        hw, x = stored(form, w["head"]), jnp.asarray(h_Ex1)
        outputs[form] = np.asarray(run(lw, hw, x))
        fns[form] = lambda run=run, lw=lw, hw=hw, x=x: run(lw, hw, x).block_until_ready()
        bytes_per[form] = params * (4 if form == "f32_weights" else 2)
    for dtype in ("bfloat16", "float32"):
        run = torch_fn(w, dtype)
        outputs[f"torch_{dtype}"] = run(h_Ex1.T).T
        fns[f"torch_{dtype}"] = lambda run=run: run(h_Ex1.T)
        bytes_per[f"torch_{dtype}"] = params * (2 if dtype == "bfloat16" else 4)
    rows = []
    med = common.alternating_medians(fns, repeats=repeats, warmup=1)
    for name, (seconds, _) in med.items():
        dtype = "float32" if name in ("f32_weights", "torch_float32") else "bfloat16"
        want = expected[dtype]
        err = float(np.abs(outputs[name] - want).max() / np.abs(want).max())
        rows.append(
            {
                "form": name,
                "dtype": dtype,
                "ms_per_token": seconds * 1e3,
                "weight_gb_s": bytes_per[name] / seconds / 1e9,
                "max_rel_err": err,
            }
        )
    common.print_table(rows, ["form", "dtype", "ms_per_token", "weight_gb_s", "max_rel_err"])
    # A form that computes something else would make its time meaningless. bf16's tolerance:
    # 30 layers of bf16 roundings, placed differently by each side, move the normalised logits
    # by a few percent; a wrong product moves them by ~100%.
    bad = [
        r["form"] for r in rows if r["max_rel_err"] > (0.15 if r["dtype"] == "bfloat16" else 1e-4)
    ]
    if bad:
        print(f"error: {', '.join(bad)} disagree with numpy's arithmetic", file=sys.stderr)
        return 1
    common.write_result(
        "matvec_forms_quick" if args.quick else "matvec_forms",
        {
            "config": {"layers": layers, "vocab": vocab, "params": params, "repeats": repeats},
            "load_before": load,
            "load_after": common.load_average(),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
