"""What this host's memory says: this process's peak resident set, and what is still free.

The start-up estimate (memory.py) is checked against `available_bytes`; every step record
carries `peak_rss_bytes` (step_record.py), as do the benchmarks' memory figures.
"""

from __future__ import annotations

import os
import sys


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (what the kernel's OOM killer would count).

    On Linux, VmHWM of /proc/self/status: getrusage's ru_maxrss survives fork and exec, so a
    child started by a large process would report its parent's peak.
    """
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass  # no procfs (macOS): getrusage below
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def available_bytes(
    *, meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup"
) -> int | None:
    """Bytes this process can still get: MemAvailable, or the cgroup's headroom if smaller.

    The cgroup (v2 memory.max / memory.current, else v1 memory.limit_in_bytes / usage_in_bytes)
    matters in containers, where MemAvailable describes the whole host. None where neither is
    known (not Linux)."""
    found = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)  # reported in kB (KiB)
                    break
    except (OSError, ValueError, IndexError):
        found = []  # no readable /proc/meminfo: only a cgroup limit, if any, says what is free
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        limit = _read_int(os.path.join(cgroup, limit_file))
        # v1 reports "no limit" as a huge number (close to 2**63): ignore anything that large.
        if limit is None or limit >= 2**60:
            continue
        usage = _read_int(os.path.join(cgroup, usage_file)) or 0
        found.append(max(limit - usage, 0))
        break
    return min(found) if found else None
