"""Run metrics: a JSONL log per run, a compact console line, and lag statistics.

Every record is one JSON object per line in `<workdir>/metrics.jsonl` with a `kind` field
("train", "sampler", "eval", "summary"), so a run can be plotted or resumed-appended without
parsing logs; train and eval records also go to TensorBoard (`<workdir>/tensorboard/`). Host
discipline: callers hand over numbers already fetched from the device.

Every launch in a workdir appends to the same file, after a "start" record: `{"kind": "start",
"step": N, "resumed": true}` when it resumed from the checkpoint of step N, `"resumed": false`
(step 0) when it started over. A killed process may have logged steps after its last
checkpoint, which the resumed one trains again; `run_history` reads the file as the run it
now is: the last record of each step, minus what a later start re-did.
"""

import json
import math
import threading
import time
from pathlib import Path

import numpy as np

from pipelinerl_jax.pipeline.tensorboard_log import TensorBoardLog
from pipelinerl_jax.rl.lag import lag_histogram

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


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


def read_records(path: str | Path) -> list[dict]:
    """Every record of a metrics.jsonl, in file order; a line cut short by a kill is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "kind" in record:
            records.append(record)
    return records


def _redone(key: tuple[str, int], step: int) -> bool:
    """Whether a resume from the checkpoint of `step` logs this (kind, step) again: its train
    steps from `step` on, and evaluations after it (the checkpoint's own was logged before it
    was saved)."""
    kind, s = key
    return s >= step if kind == "train" else s > step


def run_history(records: list[dict], resume_step: int | None = None) -> list[dict]:
    """The train and eval records that make up the run, in step order (an evaluation at step s
    before the train record of step s): the last one of each step, without those a later
    "start" record re-did or dropped. `resume_step`: also without those a resume from that
    step is about to log again."""
    kept: dict[tuple[str, int], dict] = {}

    def cut(step):
        for key in [k for k in kept if _redone(k, step)]:
            del kept[key]

    for r in records:
        if r["kind"] == "start":
            if r.get("resumed"):
                cut(int(r["step"]))
            else:
                kept.clear()
        elif r["kind"] in ("train", "eval") and isinstance(r.get("step"), int):
            kept[(r["kind"], r["step"])] = r
    if resume_step is not None:
        cut(resume_step)
    return [kept[k] for k in sorted(kept, key=lambda k: (k[1], k[0] == "train"))]


def _end_cut_line(path: Path) -> None:
    """Ends a last line that a kill cut short, so the next record starts a line of its own."""
    if path.exists() and path.stat().st_size:
        with path.open("rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")


class MetricsWriter:
    """Appends JSON records to metrics.jsonl and TensorBoard; thread-safe; flushes every record."""

    def __init__(
        self, workdir: str | Path | None, *, echo_every: int = 10, echo=print, on_train=None
    ):
        self._path = Path(workdir) / METRICS_FILE if workdir else None
        self._tb = None
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._tb = TensorBoardLog(self._path.parent / TENSORBOARD_DIR)
            _end_cut_line(self._path)
        self._lock = threading.Lock()
        self._echo_every = echo_every
        self._echo = echo
        self.echo = echo
        self._on_train = on_train  # called with each train record's step (a progress bar)
        self._t0 = time.perf_counter()
        self.history: list[dict] = []  # earlier processes' records of this run (see resume)
        self.records: list[dict] = []  # this process's

    def start(self, resumed_from: int | None = None) -> None:
        """Marks the start of this launch in metrics.jsonl; call before the first record.

        `resumed_from`: the step of the checkpoint the run resumed from. Its earlier records up
        to that checkpoint become `history`, the `time` field goes on from theirs, and the
        TensorBoard file purges what earlier files logged from that step on (None: a fresh
        start, which purges everything before it)."""
        if self._path is None:
            return
        step = resumed_from or 0
        if resumed_from is not None:  # what a fresh start leaves in the file is not this run's
            self.history = run_history(read_records(self._path), resumed_from)
            trained = {r["step"] for r in self.history if r["kind"] == "train"}
            missing = [s for s in range(resumed_from) if s not in trained]
            if missing:  # not silent: the summary's step count and curves lack them
                self.echo(
                    f"warning: {self._path} holds no record of {len(missing)} of the "
                    f"{resumed_from} steps before the checkpoint (first: step {missing[0]}; "
                    "lines cut or removed): the summary and curves leave them out"
                )
            offset = max((r.get("time", 0.0) for r in self.history), default=0.0)
            self._t0 = time.perf_counter() - offset
        self._tb.purge_step = step
        self.write("start", {"step": step, "resumed": resumed_from is not None})
        for r in self.history:  # the checkpoint step's eval sits at the purge step: keep it
            if r["step"] >= step:
                self._tb.write(r["kind"], r)

    def write(self, kind: str, record: dict) -> None:
        record = {"kind": kind, "time": round(time.perf_counter() - self._t0, 4), **record}
        line = json.dumps(record, default=_jsonable, allow_nan=True)
        with self._lock:
            self.records.append(record)
            if self._path is not None:
                with self._path.open("a") as f:
                    f.write(line + "\n")
                if kind in ("train", "eval") and self._tb is not None:
                    self._tb.write(kind, record)
        if kind == "train" and self._echo_every and record.get("step", 0) % self._echo_every == 0:
            self._echo(format_train_line(record))
        if kind == "train" and self._on_train is not None:
            self._on_train(record.get("step", 0))

    def of_kind(self, kind: str) -> list[dict]:
        """The whole run's records of `kind`: the history before a resume, then this process's."""
        with self._lock:
            return [r for r in self.history + self.records if r["kind"] == kind]

    def close(self) -> None:
        """Closes the TensorBoard file; later records go to metrics.jsonl only (it is closed
        after every record anyway)."""
        with self._lock:
            if self._tb is not None:
                self._tb.close()
                self._tb = None


def format_train_line(r: dict) -> str:
    """One console line per logged step: what a user watches while the run learns."""

    def g(key, fmt="{:.3f}"):
        v = r.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    return (
        f"step {r.get('step', 0):5d}  t={r['time']:7.1f}s  reward {g('reward/mean')}  "
        f"loss {g('loss', '{:+.4f}')}  ent {g('entropy')}  ess {g('ess')}  "
        f"lag mean {g('lag/token_mean', '{:.2f}')} max {g('lag/token_max', '{}')}  "
        f"mixed {g('seq/mixed_version_frac', '{:.2f}')}  samples/s {g('samples_per_s', '{:.1f}')}"
        + _answers(r)
        + (f"  compiles {r['compile/count']}" if r.get("compile/count") else "")
    )


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
