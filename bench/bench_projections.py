"""The decode step's layer stack without attention, ours against the same matmuls in torch.

    .venv/bin/python bench/bench_projections.py          # the timed run (machine must be idle)
    .venv/bin/python bench/bench_projections.py --quick  # a small check that everything runs

Why this exists: it isolates the part of an f32 decode step that XLA's matmul library decides.
Ours is the model's block in the sampler's CPU layout (`models.block.decoder_block` with
`FeatureMajor`: norms, q/k/v/o, RoPE, gate/up/down, residuals) over the 8 layers of the bench model, with attention replaced by "output = q", at
N = 1 / 8 / 32 / 64 tokens; the peer is the same arithmetic in torch (F.linear, token-major,
as transformers runs it). Every layer has its own weights (12.6 MB in f32), so a pass streams
101 MB of weights through the caches as a real step does; a single matmul timed in a loop
re-reads one small matrix from the nearest cache and overstates the rate at small N 1.5-2x.
Reports per-layer time, GFLOP/s, the weight read rate, and the ratio; the read rate of one
large matrix-vector product (a 166 MB [41600, 1000] f32 matrix, as much as the bench model's
weights) is the ceiling next to it. Writes bench/results/projections.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402


def ours_stack(cfg, dparams, tokens: int):
    """Jitted: the sampler's blocks on [E, N] activations with attention output = q."""
    import jax
    import jax.numpy as jnp

    from pipelinerl_jax.models import block, decoder, rope

    batch_shape = (tokens, 1)
    positions_Nx1 = jnp.arange(tokens, dtype=jnp.int32)[:, None] + 7
    inv_freq = rope.inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def attend_q(q, k, v, carry):
        return q, carry

    family, layout = decoder.family_of(cfg), block.FeatureMajor(batch_shape)

    @jax.jit
    def run(layers, x_ExN):
        cos, sin = rope.cos_sin(positions_Nx1, inv_freq, x_ExN.dtype)
        for index, lp in enumerate(layers):
            x_ExN, _ = block.decoder_block(
                cfg, family, layout, x_ExN, lp, batch_shape, cos, sin, attend_q, (index, ())
            )
        return x_ExN

    x_ExN = jnp.asarray(inputs(cfg, tokens).T)
    layers = dparams["layers"]
    return lambda: run(layers, x_ExN).block_until_ready()


def inputs(cfg, tokens: int) -> np.ndarray:
    """The activations [N, E] both sides start from."""
    return (
        np.random.default_rng(tokens).standard_normal((tokens, cfg.hidden_size)).astype(np.float32)
    )


def torch_stack(cfg, dparams, tokens: int):
    """The same blocks in torch, token-major [N, E] (attention output = q, RoPE included)."""
    import torch
    import torch.nn.functional as F

    to_t = lambda a: torch.from_numpy(np.array(a, np.float32))
    layers = [{name: to_t(w) for name, w in lp.items()} for lp in dparams["layers"]]
    eps, d = cfg.rms_norm_eps, cfg.head_dim
    pos = torch.arange(tokens, dtype=torch.float32)[:, None] + 7
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.cat([pos * inv, pos * inv], dim=-1)[:, None, :]  # [N, 1, D]
    cos, sin = ang.cos(), ang.sin()

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotary(x):
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    x0 = torch.from_numpy(inputs(cfg, tokens))

    def run():
        with torch.no_grad():
            x = x0
            for lp in layers:
                h = norm(x, lp["attn_norm"])
                q = rotary(F.linear(h, lp["q_proj"]).view(tokens, -1, d))
                F.linear(h, lp["k_proj"]), F.linear(h, lp["v_proj"])  # computed, as in decode
                x = x + F.linear(q.reshape(tokens, -1), lp["o_proj"])
                h = norm(x, lp["mlp_norm"])
                x = x + F.linear(
                    F.silu(F.linear(h, lp["gate_proj"])) * F.linear(h, lp["up_proj"]),
                    lp["down_proj"],
                )
            return x

    return run


def gemv_ceiling_gb_s(quick: bool) -> dict:
    """Read rate (GB/s) of one large f32 matrix-vector product, XLA and torch."""
    import jax
    import jax.numpy as jnp
    import torch

    rows = 4160 if quick else 41600
    a = np.random.default_rng(0).standard_normal((rows, 1000)).astype(np.float32)
    v = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    ja, jv = jnp.asarray(a), jnp.asarray(v)
    mv = jax.jit(lambda m, x: m @ x)
    ta, tv = torch.from_numpy(a), torch.from_numpy(v)
    med = common.alternating_medians(
        {"xla": lambda: mv(ja, jv).block_until_ready(), "torch": lambda: ta @ tv},
        repeats=10,
        warmup=1,
    )
    return {name: a.nbytes / m[0] / 1e9 for name, m in med.items()}


def main():
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    common.at_least(args.repeats, "--repeats")
    import jax
    import torch

    from pipelinerl_jax.models import decoder
    from pipelinerl_jax.sampler import forward as fwd

    torch.set_num_threads(os.cpu_count())
    load = common.warn_if_busy()
    common.quick_alone(args, ap, ("repeats",))
    cfg = common.bench_model_config(args.quick)
    _, params = decoder.init(cfg, jax.random.key(0))
    dparams = fwd.decode_params(cfg, params)
    weight_bytes = sum(
        w.nbytes for lp in dparams["layers"] for name, w in lp.items() if name.endswith("_proj")
    )
    flop_per_token = 2 * weight_bytes // 4
    repeats = 3 if args.quick else args.repeats
    rows = []
    for tokens in (1, 8, 32, 64):
        ours, theirs = ours_stack(cfg, dparams, tokens), torch_stack(cfg, dparams, tokens)
        # Same arithmetic on both sides, or the comparison means nothing.
        ours_NxE, theirs_NxE = np.asarray(ours()).T, theirs().numpy()
        rel_err = float(np.abs(ours_NxE - theirs_NxE).max() / np.abs(theirs_NxE).max())
        if rel_err > 1e-4:
            raise SystemExit(
                f"ours and torch disagree at N={tokens} (max rel. error "
                f"{rel_err:.1e}): the two stacks no longer compute the same thing"
            )
        med = common.alternating_medians({"ours": ours, "torch": theirs}, repeats=repeats, warmup=1)
        row = {"tokens": tokens, "max_rel_err": rel_err}
        for name, (seconds, _) in med.items():
            row[f"{name}_us_per_layer"] = seconds / cfg.num_layers * 1e6
            row[f"{name}_gflops"] = flop_per_token * tokens / seconds / 1e9
            row[f"{name}_weight_gb_s"] = weight_bytes / seconds / 1e9
        row["ratio"] = med["torch"][0] / med["ours"][0]
        rows.append(row)
        print(row, flush=True)
    ceiling = gemv_ceiling_gb_s(args.quick)
    common.print_table(
        rows,
        [
            "tokens",
            "ours_us_per_layer",
            "torch_us_per_layer",
            "ratio",
            "ours_gflops",
            "torch_gflops",
            "ours_weight_gb_s",
            "torch_weight_gb_s",
        ],
    )
    print("one large matrix-vector product, GB/s:", ceiling)
    common.write_result(
        "projections_quick" if args.quick else "projections",
        {
            "config": {
                **common.BENCH_MODEL,
                "quick": args.quick,
                "repeats": repeats,
                "weight_bytes": weight_bytes,
                "attention": "output = q (none)",
            },
            "load_before": load,
            "load_after": common.load_average(),
            "cpu": common.cpu_features(),
            "rows": rows,
            "gemv_ceiling_gb_s": ceiling,
        },
    )


if __name__ == "__main__":
    main()
