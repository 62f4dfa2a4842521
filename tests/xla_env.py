"""XLA_FLAGS for the suite and the processes its tests start.

The suite's programs are tiny, so compiling them is most of its time and running them is not.
tests/conftest.py sets `FAST_COMPILE` for the test processes, and their children inherit it:

- LLVM's optimisation off (`--xla_backend_optimization_level=0`): test_trainer 50 -> 27 s alone;
- on jaxlib 0.10, XLA:CPU's older elemental emitters instead of its MLIR fusion emitters
  (`--xla_cpu_use_fusion_emitters=false`; jaxlib 0.11 has only the new ones and would abort on
  the flag): test_rl_composition 32 -> 18 s on top of the first.

What the tests check is what the programs compute, which XLA's HLO passes (fusion, layout)
decide alike either way; f32 results agree to rounding (accumulation order may differ). A child
that needs several host devices adds `--xla_force_host_platform_device_count` to these flags
rather than replacing them.
"""

import importlib.metadata
import os


def _fast_compile() -> str:
    flags = ["--xla_backend_optimization_level=0"]
    try:
        major, minor = (int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        major, minor = 0, 0
    if (major, minor) == (0, 10):  # checked there; gone from jaxlib 0.11
        flags.append("--xla_cpu_use_fusion_emitters=false")
    return " ".join(flags)


FAST_COMPILE = _fast_compile()


def with_fast_compile(flags: str) -> str:
    """`flags` plus FAST_COMPILE, unless they already choose an optimisation level."""
    if "--xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {FAST_COMPILE}".strip()


def xla_flags(devices: int | None = None) -> str:
    """This process's XLA_FLAGS (FAST_COMPILE included) with `devices` CPU devices if given."""
    flags = with_fast_compile(os.environ.get("XLA_FLAGS", ""))
    if devices is not None:
        flags = f"{flags} --xla_force_host_platform_device_count={devices}"
    return flags


def child_env(devices: int | None = None, **extra: str) -> dict:
    """os.environ for a child process: XLA_FLAGS as `xla_flags(devices)`, plus `extra`."""
    return dict(os.environ, XLA_FLAGS=xla_flags(devices), **extra)
