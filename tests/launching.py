"""`python launch.py ...` from the repository root, as the multi-process tests run it."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(*args, timeout: float = 300, devices: int | None = None):
    """Runs launch.py with `args` to the end; `devices`: CPU devices per process."""
    env = None
    if devices is not None:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run(
        [sys.executable, "launch.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
