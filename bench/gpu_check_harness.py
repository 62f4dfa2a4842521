"""The record, log, budgets and watchdog of one bench/gpu_check.py run, and what stages share.

Its own module, not gpu_check.py: that file runs as `__main__`, so a stage module importing it
as `bench.gpu_check` would get a second copy whose `Skip` the harness's `except Skip` would not
catch. Stage modules and gpu_check.py both import this one, so there is one copy of each class.
Standard library only at import: `gpu_check.py --help` must work without JAX or torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMAT = "pipelinerl_jax.gpu_check/1"


class Skip(Exception):
    """Raised by a stage that does not apply here; its message is the recorded reason."""


class Check:
    """The JSON record, the log, the budgets and the watchdog of one gpu_check run."""

    def __init__(self, out: Path, args, budgets: dict):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.total_budget = sum(budgets[s] for s in args.stages)
        self.budgets = budgets
        self.lock = threading.RLock()
        self.children: list[subprocess.Popen] = []
        self.current: str | None = None
        self.log_file = open(out / "gpu_check.log", "a", buffering=1)
        self.record = {
            "format": FORMAT,
            "mode": "cpu_rehearsal" if args.cpu_rehearsal else "gpu",
            "command": " ".join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "budget_s": self.total_budget,
            "hard_limit_s": args.hard_limit_s,
            "stages": {},
        }

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        line = f"[{self.elapsed():7.1f}s] {msg}"
        print(line, flush=True)
        with self.lock:
            self.log_file.write(line + "\n")

    def save(self) -> None:
        """Rewrites gpu_check.json whole (temporary file + rename: never half written)."""
        with self.lock:
            self.record["elapsed_s"] = round(self.elapsed(), 2)
            path = self.out / "gpu_check.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.record, indent=2, default=_jsonable))
            tmp.replace(path)

    def run_stage(self, name: str, fn) -> None:
        """Runs fn(ctx) under the stage's budget; records ok / skipped / failed either way."""
        rec = self.record["stages"].setdefault(name, {})
        budget = self.budgets[name]
        left = self.total_budget - self.elapsed()
        if left <= 0:
            rec.update(status="skipped", reason=f"over the total budget of {self.total_budget}s")
            self.log(f"{name}: skipped ({rec['reason']})")
            self.save()
            return
        ctx = Stage(self, name, rec, deadline=self.elapsed() + min(budget, left))
        rec.update(status="running", budget_s=budget)
        self.current = name
        self.log(f"{name}: start (budget {min(budget, left):.0f}s)")
        self.save()
        start = time.perf_counter()
        try:
            fn(ctx)
            rec["status"] = "ok" if not rec.get("problems") else "failed"
        except Skip as e:
            rec.update(status="skipped", reason=str(e))
        except BaseException as e:  # noqa: BLE001 - one stage's failure must not lose the others
            if isinstance(e, KeyboardInterrupt):
                raise
            rec.update(status="failed", error=f"{type(e).__name__}: {e}")
            rec["traceback"] = traceback.format_exc()[-3000:]
        finally:
            rec["seconds"] = round(time.perf_counter() - start, 2)
            self.current = None
            msg = rec.get("reason") or rec.get("error") or "; ".join(rec.get("problems", []))
            self.log(f"{name}: {rec['status']} in {rec['seconds']}s" + (f" ({msg})" if msg else ""))
            self.save()

    def start_watchdog(self, hard_limit_s: float) -> None:
        """Past hard_limit_s: mark the running stage, write the JSON, end children, exit 124."""

        def fire():
            with self.lock:
                if self.current is not None:
                    rec = self.record["stages"][self.current]
                    rec.update(status="failed", error=f"killed by the watchdog at {hard_limit_s}s")
                self.record["watchdog"] = f"fired at {hard_limit_s}s in stage {self.current}"
                for proc in self.children:
                    if proc.poll() is None:
                        proc.kill()
                self.log(f"watchdog: past {hard_limit_s}s in stage {self.current}; exiting")
                self.save()
                self.log_file.flush()
            os._exit(124)

        timer = threading.Timer(hard_limit_s, fire)
        timer.daemon = True
        timer.start()


@dataclasses.dataclass
class Stage:
    """What a stage function gets: its JSON record, deadline and the log."""

    check: Check
    name: str
    rec: dict
    deadline: float  # check.elapsed() value at which the stage should stop starting work

    def left(self) -> float:
        return self.deadline - self.check.elapsed()

    def log(self, msg: str) -> None:
        self.check.log(f"{self.name}: {msg}")

    def save(self) -> None:
        self.check.save()

    def problem(self, msg: str) -> None:
        """A failed check inside a stage that still finished: the stage ends "failed"."""
        self.rec.setdefault("problems", []).append(msg)
        self.log(f"PROBLEM: {msg}")


def _jsonable(obj):
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


# -- shared by the stages ------------------------------------------------------------------------


def run_child(ctx: Stage, cmd, env, timeout: float, cwd=ROOT) -> dict:
    """Runs cmd; on timeout SIGINT (a run saves and stops), then SIGKILL. Output tail kept."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        ctx.check.children.append(proc)
        stopped = None
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stopped = "interrupted (SIGINT) at the stage budget"
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                stopped = "killed at the stage budget (no exit 20 s after SIGINT)"
                proc.kill()
                proc.wait()
        out.seek(0)
        text = out.read()
    for line in text.strip().splitlines()[-15:]:
        ctx.check.log(f"  | {line}")
    return {"returncode": proc.returncode, "tail": text[-4000:], "stopped": stopped}


def free_memory() -> None:
    """Drops what the last model left (Python garbage, torch's cached CUDA blocks): the next,
    larger model and transformers' copy of it share this process's GPU memory."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001, S110 - nothing to free without torch
        pass


def fmt(v) -> str:
    """A figure for a log line: 4 significant digits, or "n/a" where nothing was measured."""
    if isinstance(v, (int, float)):
        return f"{v:.4g}"
    return "n/a" if v is None else str(v)
