"""The run summary: what the end of a run reports, from its per-step records."""

from __future__ import annotations

import math

import numpy as np


def summarize(records: list[dict], wall_s: float, coord) -> dict:
    """What a run shows: reward early vs late, lag, swaps landing mid-sequence, throughput."""
    rewards = np.array([r["reward/mean"] for r in records])
    n = len(rewards)
    tenth = max(1, math.ceil(n / 10))
    hist: dict[str, int] = {}
    for r in records:
        for k, v in r.get("lag/hist", {}).items():
            hist[k] = hist.get(k, 0) + v
    # Throughput over the second half of the run: compilation and warm-up excluded.
    half = records[n // 2 :] if n >= 4 else []
    steady = (
        (len(half) - 1) / (half[-1]["time"] - half[0]["time"])
        if len(half) >= 2 and half[-1]["time"] > half[0]["time"]
        else float("nan")
    )
    return {
        "steps": n,
        "wall_s": wall_s,
        "steady_steps_per_s": steady,
        "steady_samples_per_s": steady * coord.cfg.batch_size,
        "reward/first20": float(rewards[:20].mean()) if n else float("nan"),
        "reward/last_tenth": float(rewards[-tenth:].mean()) if n else float("nan"),
        "lag/token_max": max((r.get("lag/token_max", 0) for r in records), default=0),
        "lag/bound": coord.admission.lag_bound(),
        "lag/hist": hist,
        "seq/mixed_version_frac": float(
            np.mean([r.get("seq/mixed_version_frac", 0.0) for r in records])
        )
        if n
        else 0.0,
        "sampler/swaps": len(coord.swap_pause_s),
        "sampler/swap_pause_ms_mean": 1e3 * float(np.mean(coord.swap_pause_s or [0.0])),
        "sampler/swap_latency_ms_median": 1e3 * float(np.median(coord.swap_latency_s or [0.0])),
        "sampler/busy_frac": coord.sampler_busy_s / wall_s,
        "trainer/busy_frac": coord.trainer_busy_s / wall_s,
        "samples_per_s": coord.samples_generated / wall_s,
    }


def format_summary(s: dict) -> str:
    hist = " ".join(f"{k}:{v}" for k, v in s["lag/hist"].items() if v)
    resumed = f" (this launch, resumed at step {s['resumed_from']})" if "resumed_from" in s else ""
    rate = s["steady_samples_per_s"]
    steady = (
        f"{rate:.0f} samples/s after warm-up"
        if math.isfinite(rate)
        else "samples/s after warm-up not measured (it needs 4 steps or more)"
    )
    return (
        f"done: {s['steps']} steps in {s['wall_s']:.0f}s{resumed}, "
        f"reward {s['reward/first20']:.3f} "
        f"(first 20 steps) -> {s['reward/last_tenth']:.3f} (last tenth); "
        f"{steady}; swaps {s['sampler/swaps']} "
        f"(pause {s['sampler/swap_pause_ms_mean']:.2f} ms); "
        f"sequences with >1 version {100 * s['seq/mixed_version_frac']:.0f}%; "
        f"max lag {s['lag/token_max']} (bound {s['lag/bound']}); lag histogram {hist}"
    )
