"""Fewer glibc malloc arenas for a launched run: the same work at a lower peak RSS.

glibc gives each thread that contends for the heap an arena of its own, up to 8 per core, and
memory freed into one arena serves only that arena's threads. A run has many threads (XLA's
pools, the sampler and trainer threads, the publisher, Orbax's savers), so buffers freed by one
are re-requested from the kernel by another and the high-water mark climbs. Capping the arenas
at 2 is the usual remedy for such servers (glibc's MALLOC_ARENA_MAX); the measured effect on a
LoRA run of the real config is in docs/lora.md. A MALLOC_ARENA_MAX the user set wins.

`limit` must run before the threads start (launch.py calls it first thing in main); elsewhere
(not Linux, not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_ARENA_MAX = -8  # mallopt's parameter number in glibc's malloc.h
ARENAS = 2


def limit(arenas: int = ARENAS) -> bool:
    """Caps glibc's arenas at `arenas` unless MALLOC_ARENA_MAX is set; True if it did."""
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # another C library (musl has no mallopt)
        return False
    return bool(mallopt(_M_ARENA_MAX, int(arenas)))
