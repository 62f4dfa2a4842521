"""Paged decode attention benchmark: the shipped path against a named peer in the same run.

CPU (the production CPU path is the jnp reference): one decode step's attention for one layer
of the bench model (4 kv heads, 2 query heads per kv head, head_dim 64, page 16, context 160,
batch 1/8/32/64), paged reference vs attention over a dense [B, L, K, D] cache holding the same
data. GPU: the jax-triton kernel vs the jnp reference on Llama-3-8B-like shapes, with the
kernel's achieved bandwidth against this GPU's measured device-to-device copy bandwidth.

    python bench/bench_paged_attention.py [--quick] [--dtype float32|bfloat16]
"""

import argparse
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import BENCH_MODEL, median_time, print_table, warn_if_busy, write_result  # noqa: E402
from pipelinerl_jax.kernels.paged_attention import paged_decode_attention, triton_available  # noqa: E402


def make_case(batch, context, *, kv_heads, group, head_dim, page, dtype, dense=False, seed=0):
    """Random paged cache (made on the device) with shuffled pages, every sequence at `context`
    tokens; with dense=True also the same data as a dense [B, M*S, K, D] cache."""
    pages_per_seq = math.ceil(context / page)
    num_pages = batch * pages_per_seq
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    shape = (num_pages, kv_heads, page, head_dim)  # [P, K, S, D], the engine's layout
    k = jax.random.normal(key_k, shape, jnp.float32).astype(dtype)
    v = jax.random.normal(key_v, shape, jnp.float32).astype(dtype)
    perm = np.random.default_rng(seed).permutation(num_pages)
    tables = jnp.asarray(perm.reshape(batch, pages_per_seq), jnp.int32)
    q = jax.random.normal(key_q, (batch, kv_heads * group, head_dim), jnp.float32).astype(dtype)
    lengths = jnp.full((batch,), context, jnp.int32)
    case = dict(q=q, k=k, v=v, tables=tables, lengths=lengths)
    if dense:
        case["dense_k"], case["dense_v"] = (
            x[tables]
            .transpose(0, 1, 3, 2, 4)
            .reshape(batch, pages_per_seq * page, kv_heads, head_dim)
            for x in (k, v)
        )
    return case


@jax.jit
def dense_decode_attention(q_BxHxD, k_BxLxKxD, v_BxLxKxD, lengths_B):
    """The peer: length-masked decode attention over a dense per-sequence cache (f32 softmax)."""
    batch, heads, head_dim = q_BxHxD.shape
    kv_heads = k_BxLxKxD.shape[2]
    q_BxKxGxD = q_BxHxD.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    s = (
        jnp.einsum("bkgd,blkd->bkgl", q_BxKxGxD, k_BxLxKxD, preferred_element_type=jnp.float32)
        * head_dim**-0.5
    )
    valid = (jnp.arange(k_BxLxKxD.shape[1]) < lengths_B[:, None])[:, None, None, :]
    p = jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgl,blkd->bkgd", p, v_BxLxKxD.astype(jnp.float32))
    return out.reshape(batch, heads, head_dim).astype(q_BxHxD.dtype)


def _paged_fn(impl, scale):
    return jax.jit(
        lambda q, k, v, t, n: paged_decode_attention(q, k, v, t, n, scale=scale, impl=impl)
    )


def bench_cpu(args):
    heads, kv_heads = BENCH_MODEL["num_heads"], BENCH_MODEL["num_kv_heads"]
    head_dim, page, context = BENCH_MODEL["head_dim"], 16, 160
    batches = [1, 8] if args.quick else [1, 8, 32, 64]
    repeats = 5 if args.quick else 50
    paged = _paged_fn("ref", head_dim**-0.5)
    rows = []
    for batch in batches:
        c = make_case(
            batch,
            context,
            kv_heads=kv_heads,
            group=heads // kv_heads,
            head_dim=head_dim,
            page=page,
            dtype=args.dtype,
            dense=True,
        )
        paged_args = (c["q"], c["k"], c["v"], c["tables"], c["lengths"])
        dense_args = (c["q"], c["dense_k"], c["dense_v"], c["lengths"])
        np.testing.assert_allclose(
            np.asarray(paged(*paged_args), np.float32),
            np.asarray(dense_decode_attention(*dense_args), np.float32),
            atol=2e-2 if args.dtype == "bfloat16" else 1e-5,
        )
        t_paged, _ = median_time(
            lambda: paged(*paged_args).block_until_ready(), repeats=repeats, warmup=2
        )
        t_dense, _ = median_time(
            lambda: dense_decode_attention(*dense_args).block_until_ready(),
            repeats=repeats,
            warmup=2,
        )
        kv_bytes = 2 * c["dense_k"].nbytes
        rows.append(
            dict(
                batch=batch,
                context=context,
                paged_us=t_paged * 1e6,
                dense_us=t_dense * 1e6,
                paged_over_dense=t_paged / t_dense,
                paged_gb_s=kv_bytes / t_paged / 1e9,
            )
        )
    return rows, ["batch", "context", "paged_us", "dense_us", "paged_over_dense", "paged_gb_s"]


def copy_bandwidth_gb_s(nbytes=1 << 30):
    """Device copy bandwidth: one read and one write of a large buffer per call."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    bump = jax.jit(lambda a: a + 1.0)
    med, _ = median_time(lambda: bump(x).block_until_ready(), repeats=10, warmup=2)
    return 2 * nbytes / med / 1e9


def bench_gpu(args):
    kv_heads, group, head_dim, page = 8, 4, 128, 16
    shapes = (
        [(8, 1024), (64, 2048)]
        if args.quick
        else [(1, 4096), (8, 1024), (32, 2048), (64, 2048), (128, 4096)]
    )
    repeats = 10 if args.quick else 100
    scale = head_dim**-0.5
    fast, ref = _paged_fn("triton", scale), _paged_fn("ref", scale)
    copy_bw = copy_bandwidth_gb_s()
    rows = []
    for batch, context in shapes:
        c = make_case(
            batch,
            context,
            kv_heads=kv_heads,
            group=group,
            head_dim=head_dim,
            page=page,
            dtype=args.dtype,
        )
        paged_args = (c["q"], c["k"], c["v"], c["tables"], c["lengths"])
        np.testing.assert_allclose(
            np.asarray(fast(*paged_args), np.float32),
            np.asarray(ref(*paged_args), np.float32),
            atol=2e-2 if args.dtype != "float32" else 1e-4,
        )
        t_fast, _ = median_time(
            lambda: fast(*paged_args).block_until_ready(), repeats=repeats, warmup=3
        )
        t_ref, _ = median_time(
            lambda: ref(*paged_args).block_until_ready(), repeats=repeats, warmup=3
        )
        # Bytes the kernel must move: the valid K/V rows, plus q, out and the tables.
        moved = (
            2 * batch * context * kv_heads * head_dim * c["k"].dtype.itemsize
            + 2 * c["q"].nbytes
            + c["tables"].nbytes
        )
        rows.append(
            dict(
                batch=batch,
                context=context,
                triton_us=t_fast * 1e6,
                ref_us=t_ref * 1e6,
                speedup=t_ref / t_fast,
                triton_gb_s=moved / t_fast / 1e9,
                of_copy_bw=moved / t_fast / 1e9 / copy_bw,
            )
        )
    return (
        rows,
        ["batch", "context", "triton_us", "ref_us", "speedup", "triton_gb_s", "of_copy_bw"],
        dict(copy_gb_s=copy_bw, kv_heads=kv_heads, group=group, head_dim=head_dim, page=page),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run to check it works")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    load = warn_if_busy()
    extra = {}
    if triton_available():
        rows, columns, extra = bench_gpu(args)
        mode = "gpu"
    else:
        rows, columns = bench_cpu(args)
        mode = "cpu"
    print(f"paged decode attention ({mode}, {args.dtype}, {jax.devices()[0].device_kind})")
    print_table(rows, columns)
    name = f"paged_attention_{mode}_{args.dtype}" + ("_quick" if args.quick else "")
    write_result(
        name,
        dict(
            mode=mode,
            dtype=args.dtype,
            quick=args.quick,
            load=load,
            device=jax.devices()[0].device_kind,
            rows=rows,
            **extra,
        ),
    )


if __name__ == "__main__":
    main()
