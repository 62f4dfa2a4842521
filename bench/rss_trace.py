"""A process's resident memory over time: what a peak-RSS figure alone cannot show.

The per-step `memory/peak_rss_gib` of a run is a high-water mark: it says how high memory went,
not when or during what. `RssTrace` samples a process's VmRSS (Linux /proc/PID/status) every
`interval_s` in a thread, so a trace lines up with the run's step lines and shows which phase
(train step, publish, evaluation) sets the peak: pipeline/memory.py's phase model was
calibrated on one.

    with RssTrace(proc.pid, workdir / "rss_trace.csv"):
        proc.wait()

or, around any command:

    python bench/rss_trace.py --out=/tmp/rss.csv -- python launch.py --config=...

The CSV has one row a sample: seconds since the trace started, RSS in GiB.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import threading
import time
from pathlib import Path

GiB = 2**30


def rss_bytes(pid: int) -> int | None:
    """VmRSS of `pid`, or None once it has exited (or where there is no procfs)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None  # a zombie has no VmRSS line


class RssTrace:
    """Samples a process's RSS in a thread until it exits or the trace stops; writes a CSV
    (unless `path` is None: then the samples and `peak_bytes` are all it gives, e.g. of this
    process around one call)."""

    def __init__(self, pid: int, path: Path | str | None, *, interval_s: float = 0.2):
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s} must be > 0")
        self.pid, self.interval_s = pid, interval_s
        self.path = None if path is None else Path(path)
        self.samples: list[tuple[float, int]] = []  # (seconds since start, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.is_set():
            rss = rss_bytes(self.pid)
            if rss is None:
                return
            self.samples.append((time.perf_counter() - t0, rss))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssTrace:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.write()

    @property
    def peak_bytes(self) -> int:
        """The largest sample so far (0 before the first)."""
        return max((b for _, b in self.samples), default=0)

    def write(self) -> None:
        """The samples as CSV (written to a temporary name first: never half a file)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["t_s", "rss_gib"])
            out.writerows((f"{t:.2f}", f"{b / GiB:.4f}") for t, b in self.samples)
        tmp.replace(self.path)

    def summary(self) -> str:
        if not self.samples:
            return "rss trace: no samples (the process ended first)"
        values = sorted(b for _, b in self.samples)
        pick = lambda q: values[min(len(values) - 1, int(q * len(values)))] / GiB
        return (
            f"rss trace: {len(values)} samples over {self.samples[-1][0]:.0f} s, peak "
            f"{values[-1] / GiB:.2f} GiB, median {pick(0.5):.2f}, 10th percentile {pick(0.1):.2f}"
        )


def main(argv=None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import common

    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the CSV to write")
    p.add_argument("--interval_s", type=float, default=0.2)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        common.refuse("no command given; put it after --")
    if args.interval_s <= 0:
        common.refuse(f"--interval_s={args.interval_s} must be > 0")
    common.output_file(args.out)  # checked before the command runs, not after
    try:
        proc = subprocess.Popen(command)
    except OSError as e:  # not found, not executable: nothing ran
        common.refuse(f"cannot run {command[0]!r}: {e.strerror}")
    trace = RssTrace(proc.pid, args.out, interval_s=args.interval_s)
    with trace:
        code = proc.wait()
    print(trace.summary(), f"-> {args.out}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
