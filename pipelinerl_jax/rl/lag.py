"""Policy lag of trained tokens (trained version - the version that sampled them), in buckets.

One bucketing for both ends: `lag_metrics` counts inside the jitted train step, and
`lag_histogram` on the host (pipeline/metrics.py's per-step record).
"""

import jax
import jax.numpy as jnp
import numpy as np

# Lag histogram buckets (in optimizer steps); the last bucket is open-ended.
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)


def _name(i: int) -> str:
    lo = LAG_BUCKETS[i]
    hi = LAG_BUCKETS[i + 1] if i + 1 < len(LAG_BUCKETS) else None
    return f"{lo}+" if hi is None else (str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}")


BUCKET_NAMES = tuple(_name(i) for i in range(len(LAG_BUCKETS)))  # "0", ..., "4-5", ..., "32+"


def lag_histogram(lags) -> dict[str, int]:
    """Counts of lags per bucket, keyed by BUCKET_NAMES."""
    lags = np.asarray(lags, dtype=np.int64).ravel()
    upper = LAG_BUCKETS[1:] + (None,)
    return {
        name: int(((lags >= lo) & (True if hi is None else lags < hi)).sum())
        for name, lo, hi in zip(BUCKET_NAMES, LAG_BUCKETS, upper, strict=True)
    }


def lag_metrics(versions, loss_mask, current_version) -> dict:
    """Lag (current version - token version) of the scored tokens: mean, max, bucket counts.

    Buckets and names as lag_histogram's; computed on the device inside the train step.
    """
    on = loss_mask > 0
    lag = jnp.where(on, current_version - versions, 0).reshape(-1)
    n = jnp.maximum(jnp.sum(on), 1)
    out = {"lag_mean": jnp.sum(lag) / n, "lag_max": jnp.max(lag)}
    # One segment-sum instead of a masked reduction per bucket (fewer kernels to compile).
    bucket = jnp.sum(lag[:, None] >= jnp.asarray(LAG_BUCKETS[1:])[None, :], axis=1)
    counts = jax.ops.segment_sum(
        on.reshape(-1).astype(jnp.int32), bucket, num_segments=len(LAG_BUCKETS)
    )
    for i, name in enumerate(BUCKET_NAMES):
        out[f"lag_hist/{name}"] = counts[i]
    return out
