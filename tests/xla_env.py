"""XLA_FLAGS for the suite and the processes its tests start.

The suite compiles with LLVM's optimisation off (`FAST_COMPILE`, set by tests/conftest.py for
the test processes and inherited by their children): the suite's programs are tiny, so
compiling them is most of its time and running them is not; what the tests check is what the
programs compute, which XLA's HLO passes (fusion, layout) decide alike either way. Per module it
halved the compile-bound ones (test_trainer 50 -> 27 s alone). A child that needs several host
devices adds `--xla_force_host_platform_device_count` to these flags rather than replacing them.
"""

import os

FAST_COMPILE = "--xla_backend_optimization_level=0"


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
