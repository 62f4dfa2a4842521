"""A benchmark result built row by row: written after every row, carried across runs.

Why: bench_decode_real.py measures 16 rows in ~80 min on the EPYC, longer on the Xeon, and a
session on the Xeon (the kind that lacks figures) lasts about three hours with other steps to
run. Written only at the end, a kill or a session's end lost every row. Here each finished row
is written at once (the file says `complete: false` until the grid is full), and a later run
under the same config keeps the rows it does not re-measure:

- `resume=True` measures only the rows of its grid this machine kind's file lacks (how
  bench/machine_pass.py finishes a partial result in a later session);
- otherwise it re-measures its whole grid (`--batches=1` re-measures batch 1 only) and keeps
  the other rows.

Every row carries its own `date`; the file's `date` is the oldest row's, so nothing in it looks
newer than it is. Rows made under another config (model, lengths) are dropped.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from bench import common

Key = tuple


class RowResult:
    """Rows of result `name` for this machine kind, keyed by `key_fields`, in `grid` order."""

    def __init__(
        self,
        name: str,
        config: dict,
        key_fields: Sequence[str],
        full_grid: Sequence[Key],
        *,
        previous: dict | None = None,
        write: Callable[[str, dict], Path] = common.write_result,
    ):
        self.name, self.config, self.key_fields = name, config, tuple(key_fields)
        self.full_grid = list(full_grid)
        self._write = write
        kept = previous.get("rows", []) if previous and previous.get("config") == config else []
        fallback_date = str(previous.get("date", "")) if previous else ""
        self.rows: dict[Key, dict] = {}
        for row in kept:
            self.rows[self.key(row)] = {"date": fallback_date, **row}

    def key(self, row: dict) -> Key:
        return tuple(row.get(f) for f in self.key_fields)

    def to_measure(self, grid: Sequence[Key], *, resume: bool) -> list[Key]:
        """The keys of `grid` to measure now: all of them, or with `resume` those not held."""
        return [k for k in grid if not (resume and k in self.rows)]

    def add(self, row: dict, extra: dict) -> Path:
        """Records a measured row (dated now) and writes the result with `extra` fields."""
        now = datetime.datetime.now(datetime.UTC).isoformat()
        self.rows[self.key(row)] = {**row, "date": now}
        return self.write(extra)

    def ordered(self) -> list[dict]:
        """The rows in the full grid's order, then any others (a non-default grid's)."""
        order = {k: i for i, k in enumerate(self.full_grid)}
        return [self.rows[k] for k in sorted(self.rows, key=lambda k: order.get(k, len(order)))]

    @property
    def complete(self) -> bool:
        return all(k in self.rows for k in self.full_grid)

    def write(self, extra: dict) -> Path:
        rows = self.ordered()
        payload = {
            "config": self.config,
            **extra,
            "rows": rows,
            "complete": self.complete,
            "date": min((r["date"] for r in rows if r.get("date")), default=None)
            or datetime.datetime.now(datetime.UTC).isoformat(),
        }
        return self._write(self.name, payload)


def kind_result(name: str, results: Path | None = None, kind: str | None = None) -> dict | None:
    """This machine kind's newest `name` result (by_machine/<name>.<kind>.json), or None."""
    results = common.RESULTS_DIR if results is None else results
    kind = common.machine_kind(common.cpu_features()) if kind is None else kind
    path = results / "by_machine" / f"{name}.{kind}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
