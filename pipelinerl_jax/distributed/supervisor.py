"""Runs a set of local processes as one job: their output prefixed, and all of them ended as
soon as one fails.

Why a supervisor: under jax.distributed a dead process is noticed by its peers only after the
heartbeat timeout, and then they abort (SIGABRT) without Python cleanup; SIGTERM is swallowed
by JAX's preemption notifier; a killed coordinator process takes the others down within a
second. So the job's end is decided here, not inside JAX: the first child that exits non-zero
or dies of a signal is named in one line, the others get SIGTERM and, `grace_s` later, SIGKILL
(to their whole process group, so reward workers and other grandchildren go too). Children
also get SIGKILL from the kernel if the supervisor itself dies (Linux `PR_SET_PDEATHSIG`), so
nothing is left behind even after `kill -9` of the supervisor.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from pipelinerl_jax import interrupts

_PR_SET_PDEATHSIG = 1
# The last line of a Python traceback: "ValueError: ...", "jax.errors.JaxRuntimeError: ...".
_PY_ERROR = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(: .*)?$")


@dataclasses.dataclass(frozen=True)
class Child:
    """One process of the job: how lines and errors name it, and its command line."""

    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # added to the supervisor's environment
    spare: bool = False  # its failure ends nobody (an elastic run's sampler process)


@dataclasses.dataclass
class Outcome:
    """How the job ended: 0 when every child exited 0; else the first failure's line."""

    returncode: int
    line: str | None = None  # "process 1 (sampler 0) exited with code 3: ValueError: ..."
    seconds_to_stop: float = 0.0  # from noticing the failure to the last child gone


# Linux: the child asks the kernel for SIGKILL when its parent (this supervisor) dies, then
# execs the real command (the setting survives exec). Done by a tiny launcher rather than
# Popen(preexec_fn=...): a preexec_fn forces a plain fork() of this process, which JAX (often
# imported here) warns may deadlock.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys; "
    f"ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, 9); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def _wrapped(argv: Sequence[str]) -> list[str]:
    if sys.platform != "linux":
        return list(argv)  # elsewhere the supervisor's own cleanup is the only guard
    return [sys.executable, "-c", _DIE_WITH_PARENT, *argv]


class _Running:
    def __init__(self, child: Child, echo: Callable[[str], None]):
        self.child = child
        # Enough to reach back past a native abort's stack dump to the Python error above it.
        self.tail: collections.deque[str] = collections.deque(maxlen=400)
        env = {**os.environ, **dict(child.env)}
        self.proc = subprocess.Popen(
            _wrapped(child.argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: killpg reaches grandchildren
        )
        self.reader = threading.Thread(target=self._read, args=(echo,), daemon=True)
        self.reader.start()
        # When it ended, so that of several failures seen in one poll the first is named (a
        # killed coordinator process makes its peers abort within a second).
        self.ended_at: float | None = None
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        self.proc.wait()
        self.ended_at = time.monotonic()

    def failed(self) -> bool:
        return self.ended_at is not None and self.proc.returncode != 0

    def _read(self, echo) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line.strip():
                self.tail.append(line.strip())
            echo(f"[{self.child.name}] {line}")

    def signal_group(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # already gone

    def cause(self) -> str:
        """ "exited with code 1: ValueError: ..." or "was killed by SIGABRT (after ...)".

        Under jax.distributed a Python exception often ends as SIGABRT (the runtime's
        shutdown barrier fails when a peer is gone), so a signal death also names the last
        Python error the process printed, if any."""
        code = self.proc.returncode
        error = next((t for t in reversed(self.tail) if _PY_ERROR.match(t)), None)
        if code < 0:
            name = signal.Signals(-code).name
            return f"was killed by {name}" + (f" (after {error})" if error else "")
        last = error or (self.tail[-1] if self.tail else "")
        return f"exited with code {code}" + (f": {last}" if last else "")


def _one_at_a_time(echo: Callable[[str], None]) -> Callable[[str], None]:
    """`echo` behind a lock: one reader thread per child calls it, and print writes a line and
    its newline separately, so two children's lines could run together on one line."""
    lock = threading.Lock()

    def locked(line: str) -> None:
        with lock:
            echo(line)

    return locked


def supervise(
    children: Sequence[Child],
    *,
    grace_s: float = 3.0,
    poll_s: float = 0.1,
    echo: Callable[[str], None] = print,
) -> Outcome:
    """Starts every child, waits for all of them, and ends the rest when one fails.

    Ctrl-C (KeyboardInterrupt) sends SIGINT to every child, then ends them as a failure does,
    and is re-raised. Returns the Outcome; its line is also echoed.
    """
    echo = _one_at_a_time(echo)
    running = [_Running(c, echo) for c in children]
    try:
        while True:
            for r in [r for r in running if r.child.spare and r.failed()]:
                r.reader.join(timeout=1.0)
                echo(f"{r.child.name} {r.cause()}; the others go on without it (elastic)")
                running.remove(r)
            if all(r.child.spare for r in running if r.ended_at is None) and all(
                r.proc.returncode == 0 for r in running if not r.child.spare
            ):
                # Every trainer process is done: the samplers stop on their own within
                # moments (the stop key); stragglers are ended.
                _stop([r for r in running if r.proc.poll() is None], grace_s * 3)
                for r in running:
                    r.reader.join(timeout=1.0)
                return Outcome(0)
            failures = [r for r in running if r.failed()]
            if failures:
                failed = min(failures, key=lambda r: r.ended_at)
                t0 = time.monotonic()
                others = [r for r in running if r is not failed and r.proc.poll() is None]
                _stop(others, grace_s)
                failed.reader.join(timeout=1.0)
                line = f"{failed.child.name} {failed.cause()}"
                if others:
                    line += f"; stopped the other {len(others)} process(es)"
                echo(line)
                code = failed.proc.returncode
                return Outcome(code if code > 0 else 1, line, time.monotonic() - t0)
            if all(r.ended_at is not None and r.proc.returncode == 0 for r in running):
                for r in running:
                    r.reader.join(timeout=1.0)
                return Outcome(0)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        interrupts.received()
        for r in running:
            r.signal_group(signal.SIGINT)
        _stop(running, grace_s)
        raise


def _stop(running: Sequence[_Running], grace_s: float) -> None:
    """SIGTERM each process group, SIGKILL whatever is left after grace_s; waits for all."""
    for r in running:
        r.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for r in running:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # still running after the grace: the SIGKILL below ends it
    for r in running:
        r.signal_group(signal.SIGKILL)  # the group too: grandchildren may outlive the leader
        if r.proc.poll() is None:
            r.proc.wait()
