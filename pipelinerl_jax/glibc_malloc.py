"""glibc's malloc tuned for a run: fewer arenas, and free memory handed back between steps.

A run's host buffers (XLA CPU arrays and temporaries, batches, staging copies) come from glibc's
malloc, and two of its habits raise a run's peak RSS above what it ever holds at once:

- Arenas. glibc gives each thread that contends for the heap an arena of its own, up to 8 per
  core, and memory freed into one arena serves only that arena's threads. A run has many
  threads (XLA's pools, the sampler and trainer threads, the publisher, Orbax's savers), so
  buffers freed by one are re-requested from the kernel by another. `limit_arenas` caps them at
  2, the usual remedy for such servers (glibc's MALLOC_ARENA_MAX); a MALLOC_ARENA_MAX the user
  set wins. It must run before the threads start (launch.py calls it first thing in main).
- Holes. Freed chunks below the mmap threshold stay resident inside the heaps, and the decode
  chunks' small temporaries, allocated between two train steps, fragment the space a step's
  large temporaries freed: each step then touches some fresh pages, and a real-config run's RSS
  climbed step after step. `release` (malloc_trim(0)) returns every free page inside the heaps
  to the kernel; the pipeline calls it before each train step (RunConfig.trim_host_memory),
  so a step starts from what is live. docs/real_model.md#memory has the measured effect.

Elsewhere (not Linux, not glibc) both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

_M_ARENA_MAX = -8  # mallopt's parameter number in glibc's malloc.h
ARENAS = 2


@functools.cache
def _glibc():
    """glibc's handle with mallopt and malloc_trim, or None (not Linux, or another C library:
    musl has neither)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    except (OSError, AttributeError):
        return None
    return libc


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Caps glibc's arenas at `arenas` unless MALLOC_ARENA_MAX is set; True if it did."""
    libc = _glibc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, int(arenas)))


def release() -> bool:
    """Returns the free pages inside every arena to the kernel (malloc_trim(0)); True if any
    were returned. Thread-safe (glibc locks each arena while it trims it)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
