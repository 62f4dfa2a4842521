"""Whether this host's CPU has matrix units (AMX) for XLA:CPU's 16-bit matmuls.

One choice in the CPU decode layout depends on it (`block.output_major_matmul`'s form for one
16-bit token): XLA:CPU runs a 16-bit product with f32 accumulation on AMX tiles where the CPU
has them (the Xeon: ~30 GB/s of bf16 weights at batch 1), and on plain AVX-512 it does not
(the EPYC: ~9 GB/s), where an f32 multiply-reduce reads the weights faster
(docs/cpu_measurements.md#one-16-bit-token).
"""

from __future__ import annotations

import functools


@functools.cache
def has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises AMX bf16 tiles (Linux /proc/cpuinfo flags). Elsewhere
    (no /proc, another OS) False: the form chosen then is the one measured without AMX."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_bf16" in line.split()
    except OSError:
        pass
    return False
