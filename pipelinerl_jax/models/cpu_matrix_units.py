"""Whether this host's CPU has matrix units (AMX) for XLA:CPU's 16-bit matmuls.

One choice in the CPU decode layout depends on it (`block.one_16bit_token`): XLA:CPU runs a
16-bit product with f32 accumulation on AMX tiles where the CPU has them, and on plain AVX-512
it does not, so there an f32 multiply-reduce reads the weights faster (the rates of both forms
on both machines: docs/cpu_measurements.md#one-16-bit-token).
"""

from __future__ import annotations

import functools


@functools.cache
def has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises AMX bf16 tiles (Linux /proc/cpuinfo flags). Elsewhere
    (no /proc, another OS) False: the form chosen then is the one measured without AMX."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:  # no procfs: the CPU's flags cannot be read, so none are assumed
        flags = []
    return "amx_bf16" in flags
