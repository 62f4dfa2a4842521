"""Run metrics: a JSONL log per run, a compact console line, and lag statistics.

Every record is one JSON object per line in `<workdir>/metrics.jsonl` with a `kind` field
("train", "sampler", "eval", "summary"), so a run can be plotted or resumed-appended without
parsing logs. Host discipline: callers hand over numbers already fetched from the device.
"""

import json
import math
import threading
import time
from pathlib import Path

import numpy as np

# Lag histogram buckets (in optimizer steps); the last bucket is open-ended.
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)


def lag_histogram(lags) -> dict[str, int]:
    """Counts of lags per bucket, keyed "0", "1", ..., "4-5", ..., "32+"."""
    lags = np.asarray(lags, dtype=np.int64).ravel()
    out = {}
    for i, lo in enumerate(LAG_BUCKETS):
        hi = LAG_BUCKETS[i + 1] if i + 1 < len(LAG_BUCKETS) else None
        if hi is None:
            key, n = f"{lo}+", int((lags >= lo).sum())
        elif hi == lo + 1:
            key, n = str(lo), int((lags == lo).sum())
        else:
            key, n = f"{lo}-{hi - 1}", int(((lags >= lo) & (lags < hi)).sum())
        out[key] = n
    return out


def lag_stats(token_versions, current_version: int, sequence_ids=None) -> dict:
    """Per-token and per-sequence lag of a batch trained at `current_version`.

    token_versions: versions of the trained (loss-masked) tokens. sequence_ids: the sequence of
    each token, to report per-sequence lag (that of its oldest token) as well.
    """
    versions = np.asarray(token_versions, dtype=np.int64).ravel()
    if versions.size == 0:
        return {"lag/tokens": 0}
    lags = current_version - versions
    stats = {
            "lag/token_mean": float(lags.mean()),
            "lag/token_max": int(lags.max()),
            "lag/tokens": int(lags.size),
            "lag/hist": lag_histogram(lags),
            "version/min": int(versions.min()),
            "version/max": int(versions.max()),
    }
    if sequence_ids is not None:
        seq = np.asarray(sequence_ids).ravel()
        _, inverse = np.unique(seq, return_inverse=True)
        oldest = np.full(inverse.max() + 1, np.iinfo(np.int64).max)
        np.minimum.at(oldest, inverse, versions)
        seq_lags = current_version - oldest
        stats["lag/seq_mean"] = float(seq_lags.mean())
        stats["lag/seq_max"] = int(seq_lags.max())
        # Sequences whose tokens come from more than one version: in-flight swaps landed in them.
        newest = np.full(inverse.max() + 1, np.iinfo(np.int64).min)
        np.maximum.at(newest, inverse, versions)
        stats["seq/mixed_version_frac"] = float((newest > oldest).mean())
    return stats


class MetricsWriter:
    """Appends JSON records to metrics.jsonl; thread-safe; flushes every record."""

    def __init__(self, workdir: str | Path | None, *, echo_every: int = 10, echo=print):
        self._path = Path(workdir) / "metrics.jsonl" if workdir else None
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._echo_every = echo_every
        self._echo = echo
        self.echo = echo
        self._t0 = time.perf_counter()
        self.records: list[dict] = []

    def write(self, kind: str, record: dict) -> None:
        record = {"kind": kind, "time": round(time.perf_counter() - self._t0, 4), **record}
        line = json.dumps(record, default=_jsonable, allow_nan=True)
        with self._lock:
            self.records.append(record)
            if self._path is not None:
                with self._path.open("a") as f:
                    f.write(line + "\n")
        if kind == "train" and self._echo_every and record.get("step", 0) % self._echo_every == 0:
            self._echo(format_train_line(record))

    def of_kind(self, kind: str) -> list[dict]:
        with self._lock:
            return [r for r in self.records if r["kind"] == kind]


def format_train_line(r: dict) -> str:
    """One console line per logged step: what a user watches while the run learns."""
    def g(key, fmt="{:.3f}"):
        v = r.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)
    return (f"step {r.get('step', 0):5d}  t={r['time']:7.1f}s  reward {g('reward/mean')}  "
                    f"loss {g('loss', '{:+.4f}')}  ent {g('entropy')}  ess {g('ess')}  "
                    f"lag mean {g('lag/token_mean', '{:.2f}')} max {g('lag/token_max', '{}')}  "
                    f"mixed {g('seq/mixed_version_frac', '{:.2f}')}  samples/s {g('samples_per_s', '{:.1f}')}"
            + _answers(r) + (f"  compiles {r['compile/count']}" if r.get("compile/count") else ""))


def _answers(r: dict) -> str:
    """'  correct 0.12 answered 0.40' when answer statuses were counted (answered: a parsed
    final answer, right or wrong), so a reward of 0 says whether answers are wrong or absent."""
    if "status/correct" not in r:
        return ""
    answered = r["status/correct"] + r.get("status/wrong", 0.0)
    return f"  correct {r['status/correct']:.2f} answered {answered:.2f}"


def _jsonable(obj):
    if isinstance(obj, (np.floating, np.integer, np.bool_)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
