"""The paper's two planner figures as PNGs (matplotlib, Agg backend, no display needed).

Figure 7: per-device utilisation (or tokens/s) against per-device batch h.
Figure 8: best PipelineRL throughput and Conventional RL throughput against the max lag bound.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: headless machines and tests have no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pipelinerl_jax.plan.utilisation import UNIT_FRACTION, UtilisationCurve  # noqa: E402


def plot_utilisation(
    curve: UtilisationCurve, path: str | Path, *, chosen_batch: float | None = None
) -> Path:
    """U(h) (or tokens/s per device) at the measured points, with the interpolation between."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    hs = np.asarray(curve.batch_sizes)
    dense = np.linspace(min(1.0, hs[0]), hs[-1], 512)
    ax.plot(dense, curve.rate(dense), "-", color="tab:blue", lw=1, label="interpolated")
    if hs.size <= 64:  # a derived curve has a point per integer h: the line already shows it
        ax.plot(hs, curve.values, "o", color="tab:blue", ms=3, label="profile points")
    if chosen_batch is not None:
        ax.axvline(chosen_batch, color="tab:red", ls="--", lw=1, label=f"plan H={chosen_batch:g}")
    ax.set_xlabel("per-device batch size h")
    ax.set_ylabel("utilisation U(h)" if curve.unit == UNIT_FRACTION else "tokens/s per device")
    ax.set_title(curve.source or "utilisation", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_lag_sweep(
    sweep: dict,
    path: str | Path,
    *,
    unit: str,
    title: str = "",
    chosen: tuple[int, float] | None = None,
) -> Path:
    """Throughput of both methods against the max lag (NaN points are left out)."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    lags = np.asarray(sweep["max_lag"])
    ax.step(
        lags, sweep["pipeline"], where="post", color="tab:orange", label="PipelineRL (best H, I)"
    )
    ax.plot(lags, sweep["conventional"], color="tab:blue", label="Conventional RL (G = lag + 1)")
    if chosen is not None:
        ax.plot([chosen[0]], [chosen[1]], "*", color="tab:red", ms=10, label="plan")
    ax.set_xlabel("max lag g_max (optimizer steps)")
    ax.set_ylabel(f"throughput ({unit})")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
