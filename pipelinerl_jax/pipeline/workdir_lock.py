"""One run at a time in a workdir: an exclusive lock held from before config.json is written
until the run ends.

Two launches into one workdir each resumed the same checkpoint, deleted each other's newer
ones, interleaved their records in metrics.jsonl and left half-written steps behind. The
second launch is now refused in one line naming the process that holds the workdir. The lock
is `flock` on `<workdir>/.lock`, so the kernel releases it when its process ends however it
ends (kill -9 included): a relaunch after a crash is never refused by a stale lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from pipelinerl_jax.errors import ConfigError

LOCK_FILE = ".lock"


@contextlib.contextmanager
def hold(workdir: str | os.PathLike) -> Iterator[None]:
    """Holds the workdir's lock for the `with` block; a one-line ConfigError when another
    process holds it."""
    path = Path(workdir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"--workdir={workdir} is not writable: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            raise ConfigError(
                f"--workdir={workdir} is in use by a run still going ({holder}): wait for it "
                "to end, or name another --workdir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
