"""Every module of the package imports, on whichever jax this venv has.

Under `make test-jax011` the modules whose tests compare against torch are left out of the
run (tests/conftest.py); this still imports them on jax 0.11, so an API that moved between jax
versions fails here by name rather than on a researcher's GPU machine.
"""

import importlib
import pkgutil

import pytest

import pipelinerl_jax

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(pipelinerl_jax.__path__, prefix="pipelinerl_jax.")
)
# Triton kernels need triton itself; the package imports it only where the kernel is used.
NEEDS_TRITON = {"pipelinerl_jax.kernels.paged_attention_triton"}


def test_the_package_has_its_modules():
    assert len(MODULES) > 50 and "pipelinerl_jax.plan.gpu_compile" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    if name in NEEDS_TRITON:
        pytest.importorskip("triton")
    importlib.import_module(name)
