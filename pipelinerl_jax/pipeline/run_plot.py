"""A picture of a run: reward, success, entropy, lag and throughput over optimizer steps.

    plot_run(train_records, eval_records, Path(workdir) / "curves.png")
    python -m pipelinerl_jax.pipeline.run_plot --workdir=/tmp/run      # redraw from metrics.jsonl

The run writes `<workdir>/curves.png` at every checkpoint and at its end (see pipeline/runner.py)
from the same records as metrics.jsonl. Held-out evaluations, when the run has them, are drawn
as points on the reward (avg@k) and success (pass@k) panels. Drawn with matplotlib's
object API on the Agg canvas: no display, no pyplot global state, so the trainer thread can
draw while the main thread does anything else.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from pathlib import Path

import numpy as np

from pipelinerl_jax.pipeline.metrics import METRICS_FILE, read_records, run_history

PLOT_FILE = "curves.png"

# (panel title, [(record key, label)], eval key drawn as points or None)
PANELS = (
    ("reward", [("reward/mean", "train reward")], "avg@k"),
    ("success", [("success", "train success")], "pass@k"),
    ("entropy", [("entropy", "policy entropy")], None),
    (
        "lag (optimizer steps)",
        [("lag/token_mean", "mean"), ("lag/token_max", "max"), ("lag/bound", "bound")],
        None,
    ),
    ("throughput", [("samples_per_s", "samples/s")], None),
)


def _series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that have a finite number under `key`."""
    pts = [
        (r["step"], float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))
    ]
    if not pts:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pts)
    return np.asarray(steps), np.asarray(values)


def _smooth(values: np.ndarray) -> np.ndarray:
    """Trailing mean over ~1/20 of the run: per-step rewards of a small batch are noisy."""
    window = max(1, len(values) // 20)
    if window == 1:
        return values
    cumsum = np.cumsum(np.insert(values, 0, 0.0))
    out = np.empty_like(values)
    out[window - 1 :] = (cumsum[window:] - cumsum[:-window]) / window
    out[: window - 1] = cumsum[1:window] / np.arange(1, window)
    return out


def plot_run(train: list[dict], evals: list[dict], path: str | Path, title: str = "") -> Path:
    """Draws the panels to `path` (PNG), written under a temporary name and renamed, so a
    kill mid-write leaves the previous picture."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 2.0 * len(PANELS)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for ax, (name, keys, eval_key) in zip(axes, PANELS):
        for key, label in keys:
            steps, values = _series(train, key)
            if not len(steps):
                continue
            if key in ("reward/mean", "success", "entropy"):
                (line,) = ax.plot(steps, values, alpha=0.3, linewidth=0.8)
                ax.plot(steps, _smooth(values), color=line.get_color(), label=label)
            else:
                ax.plot(steps, values, label=label, linestyle="--" if key == "lag/bound" else "-")
        if eval_key is not None:
            steps, values = _series(evals, eval_key)
            if len(steps):
                ax.plot(steps, values, "o-", label=f"held-out {eval_key}")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
        else:
            ax.text(
                0.5,
                0.5,
                "not recorded",
                transform=ax.transAxes,
                ha="center",
                va="center",
                color="gray",
            )
    axes[-1].set_xlabel("optimizer step")
    if title:
        fig.suptitle(title)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def plot_workdir(workdir: str | Path) -> Path:
    """Redraws `<workdir>/curves.png` from its metrics.jsonl (the last record of each step)."""

    records = read_records(Path(workdir) / METRICS_FILE)
    if not any(r["kind"] == "train" for r in records):
        raise ValueError(f"{Path(workdir) / METRICS_FILE} has no train records to plot")
    kept = run_history(records)
    return plot_run(
        [r for r in kept if r["kind"] == "train"],
        [r for r in kept if r["kind"] == "eval"],
        Path(workdir) / PLOT_FILE,
        title=str(workdir),
    )


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="a run's directory (metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        print(plot_workdir(args.workdir))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
