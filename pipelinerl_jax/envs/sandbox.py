"""Run a model's Python in a child process with limits: wall and CPU time, address space, file
size and open files, an empty working folder, no inherited environment variables, Python's
isolated mode (no site-packages of the user's, no PYTHON* variables, no current folder on the
path). What it prints comes back, cut to a length; an exception comes back as its last line
("ZeroDivisionError: division by zero"), as a notebook would show it without the frames.

A notebook cell's habit is kept: a block whose last statement is an expression shows that
value (`2**10` shows 1024). `earlier` blocks run first, in the same namespace, with their
output dropped and half the time at most: the state an episode built in its earlier calls,
without a process kept alive between turns (a turn is a pure function of the episode's text,
so a restarted worker, a resumed run or a replay computes the same answer).

This is a limit on mistakes, not a security boundary: the code runs as the training user, can
read what that user can and reach the network. Train a policy you do not trust in a container
or a VM without network.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs inside the child: limits itself (no preexec_fn, which is unsafe in a threaded parent),
# then reads {"limits": ..., "earlier": [...], "code": "..."} from stdin. Standard library
# only, and names that cannot clash with the model's (leading underscores).
_HARNESS = r"""
import ast, contextlib, io, json, resource, signal, sys
_job = json.loads(sys.stdin.read())
for _name, _value in _job["limits"].items():
    _kind = getattr(resource, _name)
    resource.setrlimit(_kind, (_value, _value))
_ns = {"__name__": "__main__"}


# The earlier blocks' time is up: a BaseException, so a looping block's `except Exception`
# cannot swallow it. A marker class, nothing to define.
class _Late(BaseException):
    pass


def _late(*_):
    raise _Late()


# Earlier blocks get half the time: one that looped (and timed out in its own turn) must not
# take every later block's time with it. Past it, the rest of them are skipped.
signal.signal(signal.SIGALRM, _late)
signal.setitimer(signal.ITIMER_REAL, _job["earlier_s"])
try:
    for _block in _job["earlier"]:
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                exec(compile(_block, "<earlier>", "exec"), _ns)
        except _Late:
            raise
        except BaseException:
            pass  # it failed in its own turn too, where the model saw why: its state is partial
except _Late:
    pass  # out of time: the blocks after it are skipped, the new block still runs
finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
try:
    _tree = ast.parse(_job["code"], "<code>")
    _last = None
    if _tree.body and isinstance(_tree.body[-1], ast.Expr):
        _last = ast.Expression(_tree.body.pop().value)
    exec(compile(_tree, "<code>", "exec"), _ns)
    if _last is not None:
        _value = eval(compile(_last, "<code>", "eval"), _ns)
        if _value is not None:
            print(repr(_value))
except SystemExit as _e:
    if _e.code not in (None, 0):
        sys.stderr.write(f"SystemExit: {_e.code}")
        sys.exit(1)
except BaseException as _e:
    _text = str(_e).splitlines()[0] if str(_e) else ""
    sys.stderr.write(type(_e).__name__ + (": " + _text if _text else ""))
    sys.exit(1)
"""
# Libraries the code may import start one thread (and its address space) per core otherwise.
_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0  # wall time of the whole call, earlier blocks included
    memory_mb: int = 1024  # address space of the child
    max_output_chars: int = 512  # of stdout (and the error line) shown back
    file_mb: int = 8  # the largest file it may write, its printed output included

    def rlimits(self) -> dict[str, int]:
        return {
            "RLIMIT_AS": self.memory_mb * 2**20,
            "RLIMIT_CPU": max(1, math.ceil(self.timeout_s)) + 1,
            "RLIMIT_FSIZE": self.file_mb * 2**20,
            "RLIMIT_CORE": 0,
        }


@dataclasses.dataclass(frozen=True)
class Result:
    output: str  # what it printed, cut to max_output_chars ("...[cut]" at the end if cut)
    error: str | None  # "NameError: name 'x' is not defined", "timed out after 5s", ...
    timed_out: bool = False


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + "...[cut]"


def _head(path: Path, n: int) -> str:
    """The first n characters of a file the child wrote (never more read into memory)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(n + 1)


def run_python(code: str, limits: Limits = Limits(), earlier: tuple[str, ...] = ()) -> Result:
    """Run `code` (after `earlier`, their output dropped) in a limited child process."""
    job = json.dumps(
        {
            "limits": limits.rlimits(),
            "earlier": list(earlier),
            "earlier_s": limits.timeout_s / 2 if earlier else 0,
            "code": code,
        }
    )
    n = limits.max_output_chars
    with tempfile.TemporaryDirectory(prefix="prl_python_") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        (Path(tmp) / "job.json").write_text(job)
        # Output goes to files, not pipes: a loop that prints forever stops at the file size
        # limit instead of filling this process's memory.
        with (
            open(Path(tmp) / "job.json") as stdin,
            open(Path(tmp) / "out.txt", "w") as stdout,
            open(Path(tmp) / "err.txt", "w") as stderr,
        ):
            proc = subprocess.Popen(
                [sys.executable, "-I", "-u", "-c", _HARNESS],
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                cwd=work,
                env={"PATH": os.defpath, "HOME": str(work), "TMPDIR": str(work), **_ENV},
                start_new_session=True,  # its own process group: a timeout kills its children
            )
            try:
                proc.wait(timeout=limits.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)  # on time out, and whatever it left running in its group
                proc.wait()
        output = _cut(_head(Path(tmp) / "out.txt", n), n)
        err = _head(Path(tmp) / "err.txt", 4 * n)
    code_ = proc.returncode
    if timed_out or code_ in (-signal.SIGXCPU, -signal.SIGKILL):
        return Result(output, f"timed out after {limits.timeout_s:g}s", timed_out=True)
    if code_ == -signal.SIGXFSZ:
        return Result(output, f"wrote more than {limits.file_mb} MB (output included)")
    if code_ == 0:
        return Result(output, None)
    lines = [line for line in err.splitlines() if line.strip()]
    error = lines[-1] if lines else f"exited with code {code_}"
    return Result(output, _cut(error, n))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # gone already: its group is empty
