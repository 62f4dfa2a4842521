"""The suite's XLA_FLAGS (tests/xla_env.py): LLVM optimisation off in the test processes and
their children, a level the user chose kept, host devices added to the flags, not over them."""

import os
import subprocess
import sys

from tests.xla_env import FAST_COMPILE, child_env, with_fast_compile, xla_flags


def test_the_suite_runs_with_fast_compile():
    assert FAST_COMPILE in os.environ["XLA_FLAGS"]


def test_a_level_the_user_chose_is_kept():
    assert with_fast_compile("") == FAST_COMPILE
    assert with_fast_compile("--xla_dump_to=/tmp/x") == f"--xla_dump_to=/tmp/x {FAST_COMPILE}"
    mine = "--xla_backend_optimization_level=3 --xla_dump_to=/tmp/x"
    assert with_fast_compile(mine) == mine


def test_a_child_gets_its_devices_and_keeps_fast_compile():
    assert xla_flags(3).split()[-1] == "--xla_force_host_platform_device_count=3"
    code = "import os, jax; print(len(jax.devices()), os.environ['XLA_FLAGS'])"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(3, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    count, *flags = done.stdout.split()
    assert count == "3" and FAST_COMPILE in " ".join(flags)
