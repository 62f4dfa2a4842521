"""Prefill forward throughput: pipelinerl_jax vs transformers on the same weights, CPU.

The project's benchmark model (bench.common.BENCH_MODEL, Llama-style, 57.9M params, untied
head) at batch 8 x 512 tokens, f32 and bf16. Our params are random, exported with save_hf
and loaded by transformers, so both run the same weights on the same tokens (the script
checks that their logits agree). Reports median seconds (the two timed in alternating rounds,
bench.common.alternating_medians), tokens/s, the ratio ours / transformers, and the forward's
achieved GFLOP/s as a fraction of this machine's measured f32 matmul rate (FLOPs = 2 * matmul
params * tokens + 4 * B * T^2 * H * D * L for the attention scores and weighted sum, which both
implementations compute in full before masking).

  .venv/bin/python bench/bench_forward.py            # full size (idle machine, a few minutes)
  .venv/bin/python bench/bench_forward.py --quick    # reduced size, to check it runs
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from pipelinerl_jax.models import param_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    BENCH_MODEL,
    ArgumentParser,
    alternating_medians,
    at_least,
    f32_matmul_gflops,
    names_list,
    print_table,
    warn_if_busy,
    write_result,
)
from pipelinerl_jax.models import decoder, hf_io  # noqa: E402
from pipelinerl_jax.models.config import ModelConfig  # noqa: E402


def bench_config(dtype: str) -> ModelConfig:
    m = BENCH_MODEL
    return ModelConfig(
        model_type="llama",
        vocab_size=m["vocab_size"],
        hidden_size=m["hidden_size"],
        intermediate_size=m["intermediate_size"],
        num_layers=m["num_layers"],
        num_heads=m["num_heads"],
        num_kv_heads=m["num_kv_heads"],
        head_dim=m["head_dim"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=2048,
        tie_word_embeddings=m["tie_word_embeddings"],
        attention_bias=False,
        qk_norm=False,
        param_dtype=dtype,
        compute_dtype=dtype,
    )


def forward_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    matmul = 2.0 * param_counts.matmul_params_per_token(cfg) * batch * seq
    attention = 4.0 * batch * seq * seq * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return matmul + attention


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 2 x 64, 2 repeats: a smoke run")
    parser.add_argument("--batch", type=int, default=None, help="default 8 (--quick: 2)")
    parser.add_argument("--seq", type=int, default=None, help="default 512 (--quick: 64)")
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (--quick: 2)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args(argv)
    dtypes = names_list(args.dtypes, "--dtypes", ("float32", "bfloat16"))
    batch = at_least(args.batch, "--batch") or (2 if args.quick else 8)
    seq = at_least(args.seq, "--seq") or (64 if args.quick else 512)
    repeats = at_least(args.repeats, "--repeats") or (2 if args.quick else 5)

    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)

    load = warn_if_busy()
    peak = f32_matmul_gflops(n=1024 if args.quick else 2048)
    print(f"f32 matmul rate: {peak:.1f} GFLOP/s")
    tokens = np.random.default_rng(0).integers(0, BENCH_MODEL["vocab_size"], (batch, seq))
    positions = np.broadcast_to(np.arange(seq), (batch, seq))
    rows = []
    for dtype in dtypes:
        cfg = bench_config(dtype)
        graphdef, params = decoder.init(cfg, jax.random.key(0))
        tokens_j = jnp.asarray(tokens, jnp.int32)
        positions_j = jnp.asarray(positions, jnp.int32)

        def ours():
            return decoder.jit_forward(graphdef, params, tokens_j, positions_j).block_until_ready()

        with tempfile.TemporaryDirectory() as tmp:
            hf_io.save_hf(tmp, cfg, params)
            torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch_dtype).eval()
        tokens_t = torch.tensor(tokens)

        def theirs():
            with torch.inference_mode():
                return model(tokens_t).logits

        ref = theirs().float().numpy()
        err = float(np.abs(np.asarray(ours()) - ref).max() / np.abs(ref).max())
        print(f"{dtype}: logits max rel diff ours vs transformers {err:.2e}")
        flops = forward_flops(cfg, batch, seq)
        results = {}
        # bf16 on CPU is several times slower (no native bf16 matmul): fewer repeats there.
        n = repeats if dtype == "float32" else max(2, (repeats + 1) // 2)
        timed = alternating_medians(
            {"pipelinerl_jax": ours, "transformers": theirs}, repeats=n, warmup=1
        )
        for name, (med, times) in timed.items():
            results[name] = med
            rows.append(
                {
                    "impl": name,
                    "dtype": dtype,
                    "batch": batch,
                    "seq": seq,
                    "median_s": med,
                    "times_s": times,
                    "tokens_per_s": batch * seq / med,
                    "gflops": flops / med / 1e9,
                    "frac_f32_peak": flops / med / 1e9 / peak,
                    "logits_rel_diff": err,
                }
            )
        rows[-2]["ratio_vs_transformers"] = results["transformers"] / results["pipelinerl_jax"]
        model = params = None  # frees both before the next dtype is built
    print_table(
        rows,
        [
            "impl",
            "dtype",
            "batch",
            "seq",
            "median_s",
            "tokens_per_s",
            "gflops",
            "frac_f32_peak",
            "ratio_vs_transformers",
        ],
    )
    write_result(
        "forward_quick" if args.quick else "forward",
        {
            "benchmark": "prefill forward, ours vs transformers on the same weights",
            "model": dict(BENCH_MODEL, num_params=param_counts.num_params(bench_config("float32"))),
            "f32_matmul_gflops": peak,
            "load": load,
            "repeats": repeats,
            "flops_per_forward": forward_flops(bench_config("float32"), batch, seq),
            "command": " ".join(["bench/bench_forward.py"] + sys.argv[1:]),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
