"""Measuring a device profile for the planner on the current JAX backend.

U(h), the paper's recipe (Appendix A, Figure 7): time the matmul (m, h)·(h, n) (m = 4096,
n = 16384 in bf16 on an accelerator) and report useful FLOPs 2·m·h·n over time over peak, best
over padding h up to h + max_pad, because utilisation jumps where the padded size is divisible by
a higher power of two (up to 128). We time only the padded sizes that can win: h rounded up to a
multiple of 2^j, j = 0..7, within the padding budget (a size between two such roundings is never
better aligned than the smaller rounding, and costs more work).

Peak FLOP/s: published dense peaks for known accelerators (`KNOWN_PEAKS`), `peak_flops` when the
caller knows better, and on CPU (which publishes none) the best rate we observed, from a square
matmul or any point of the curve, so U stays within (0, 1].

Hooks for the talk's inputs: `measure_decode_latency(make_step, batch_sizes)` times one decode
step per batch size, `measure_train_throughput(step, tokens_per_step)` times training. They take
plain callables, so the sampler engine and trainer plug in without this module knowing their
internals.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.plan.utilisation import UNIT_FRACTION, PlanError, UtilisationCurve

# Dense (no sparsity) tensor-core peaks in FLOP/s, by a substring of jax's device_kind.
KNOWN_PEAKS = {
    "bfloat16": (
        ("H200", 989.4e12),
        ("H100 PCIe", 756.0e12),
        ("H100", 989.4e12),
        ("A100", 312.0e12),
        ("L4", 121.0e12),
    ),
}
KNOWN_PEAKS["float16"] = KNOWN_PEAKS["bfloat16"]

PAPER_M, PAPER_N = 4096, 16384
CPU_M, CPU_N = 512, 2048  # reduced so the whole recipe runs in seconds to minutes on a CPU
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


def padding_candidates(h: int, max_pad: int = 64) -> list[int]:
    """Sizes worth timing for batch h: h rounded up to multiples of 1, 2, 4, ..., 128."""
    if h < 1:
        raise PlanError(f"--batch_sizes: {h} is not a positive batch size")
    out = {h}
    for j in range(1, 8):
        k = 1 << j
        padded = -(-h // k) * k
        if padded <= h + max_pad:
            out.add(padded)
    return sorted(out)


def known_peak_flops(device_kind: str, dtype: str) -> float | None:
    for key, peak in KNOWN_PEAKS.get(dtype, ()):
        if key.lower() in device_kind.lower():
            return peak
    return None


def call_times(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of fn() after `warmup` calls; fn must block."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def time_call(
    fn: Callable[[], object],
    *,
    repeats: int = 5,
    warmup: int = 1,
    statistic: Callable = statistics.median,
) -> float:
    """Seconds of fn() over repeats (median by default); fn must block until ready."""
    return statistic(call_times(fn, repeats=repeats, warmup=warmup))


def _matmul_seconds(m: int, k: int, n: int, dtype, repeats: int, seed: int) -> float:
    # Host-drawn inputs: a jax.random draw would cost one more compile per shape.
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
    b = jnp.asarray(rng.standard_normal((k, n), np.float32), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    # Fastest of the repeats: U(h) is what the device can do, and other work only adds time.
    return time_call(lambda: mm(a, b).block_until_ready(), repeats=repeats, statistic=min)


def square_matmul_flops(size: int, dtype: str, repeats: int = 3) -> float:
    """FLOP/s of a square matmul: the reference peak where no published one applies."""
    sec = _matmul_seconds(size, size, size, jnp.dtype(dtype), repeats, seed=1)
    return 2.0 * size**3 / sec


def matmul_utilisation(
    batch_sizes: Sequence[int],
    *,
    m: int,
    n: int,
    dtype: str,
    max_pad: int = 64,
    repeats: int = 5,
    peak_flops: float | None = None,
    reference_size: int = 1024,
) -> dict:
    """The U(h) recipe; returns the profile's 'utilisation' section (a curve plus raw timings)."""
    hs = sorted({int(h) for h in batch_sizes})
    if not hs or hs[0] < 1:
        raise PlanError(f"--batch_sizes={list(batch_sizes)}: need positive batch sizes")
    dt = jnp.dtype(dtype)
    seconds: dict[int, float] = {}
    for h in hs:
        for k in padding_candidates(h, max_pad):
            if k not in seconds:
                seconds[k] = _matmul_seconds(m, k, n, dt, repeats, seed=k)
    best_pad, best_sec = [], []
    for h in hs:
        k = min(padding_candidates(h, max_pad), key=lambda c: seconds[c])
        best_pad.append(k)
        best_sec.append(seconds[k])
    achieved = np.array([2.0 * m * h * n for h in hs]) / np.array(best_sec)
    device = jax.devices()[0]
    peak_source = "given"
    if peak_flops is None:
        peak_flops = known_peak_flops(getattr(device, "device_kind", ""), dt.name)
        peak_source = f"published dense peak for {device.device_kind}"
    if peak_flops is None:
        ref = square_matmul_flops(reference_size, dt.name)
        peak_flops = max(ref, float(achieved.max()))
        peak_source = (
            f"best observed rate (square {reference_size} matmul {ref / 1e9:.1f} "
            f"GFLOP/s, curve max {achieved.max() / 1e9:.1f} GFLOP/s): no published peak"
        )
    curve = UtilisationCurve(
        tuple(float(h) for h in hs),
        tuple(achieved / peak_flops),
        unit=UNIT_FRACTION,
        source=f"matmul ({m},h)x(h,{n}) {dt.name} on {device.device_kind}",
    )
    return {
        **curve.to_dict(),
        "recipe": {
            "m": m,
            "n": n,
            "dtype": dt.name,
            "max_pad": max_pad,
            "repeats": repeats,
            "statistic": "min",
        },
        "peak_flops": peak_flops,
        "peak_source": peak_source,
        "best_padded_batch": best_pad,
        "seconds": best_sec,
    }


def measure_decode_latency(
    make_step: Callable[[int], Callable[[], object]],
    batch_sizes: Sequence[int],
    *,
    repeats: int = 5,
    statistic: Callable = min,
) -> list[float]:
    """Seconds per call at each batch size (fastest repeat by default: a capability, and other
    work on the machine only adds time); make_step(b) returns a blocking zero-arg call that
    advances b sequences (one untimed warm-up call compiles it)."""
    return [time_call(make_step(int(b)), repeats=repeats, statistic=statistic) for b in batch_sizes]


def measure_train_throughput(
    step: Callable[[], object], tokens_per_step: int, *, repeats: int = 3, statistic: Callable = min
) -> float:
    """Training tokens/s of a blocking train-step callable that consumes tokens_per_step."""
    return tokens_per_step / time_call(step, repeats=repeats, statistic=statistic)


def matmul_profile(
    *,
    batch_sizes: Sequence[int] | None = None,
    m: int | None = None,
    n: int | None = None,
    dtype: str | None = None,
    max_pad: int = 64,
    repeats: int = 5,
    peak_flops: float | None = None,
) -> dict:
    """A whole profile dict from the matmul recipe, with backend-appropriate defaults."""
    on_cpu = jax.default_backend() == "cpu"
    m = m or (CPU_M if on_cpu else PAPER_M)
    n = n or (CPU_N if on_cpu else PAPER_N)
    dtype = dtype or ("float32" if on_cpu else "bfloat16")
    util = matmul_utilisation(
        batch_sizes or DEFAULT_BATCH_SIZES,
        m=m,
        n=n,
        dtype=dtype,
        max_pad=max_pad,
        repeats=repeats,
        peak_flops=peak_flops,
    )
    return {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "utilisation": util,
    }
