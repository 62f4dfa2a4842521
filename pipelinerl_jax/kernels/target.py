"""The platform a program is being traced for, which is not always the one running the trace.

Choices made while tracing (the Triton kernel or the jnp reference, CPU-only layouts of 16-bit
saves and transposes) must follow the device the program will run on. Normally that is
`jax.default_backend()`. When a CPU process compiles ahead of time for an H100 topology
(`jax.experimental.topologies`, plan/gpu_compile.py), the default backend is still the CPU, so
those choices would silently build the CPU program for the GPU. `compiling_for("gpu", 90)`
says, for the traces made inside it, that the target is an NVIDIA GPU of that compute
capability: `platform()` answers "gpu", the kernel dispatch takes the Triton path, and
jax-triton is told the compute capability instead of querying a device that is not there.

The target is a JAX configuration state included in the trace context, so jit's trace caches
are keyed by it: a function traced for the CPU is traced anew for the GPU, never reused.
(`jax._src.config.State` is internal API, checked on jax 0.10.2 and 0.11.2; where it is
missing the target falls back to a context variable, under which a function must be traced
for one target per process.)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

__all__ = ["Target", "compiling_for", "current", "platform"]


@dataclasses.dataclass(frozen=True)
class Target:
    platform: str  # "gpu" | "cpu" | "tpu": what jax.default_backend() says on the target
    compute_capability: int | None = None  # NVIDIA sm version (90 = Hopper), when known


def _make_state():
    try:
        from jax._src import config as jax_config

        return jax_config.State(
            "pipelinerl_jax_compile_target",
            "",
            "platform[:compute capability] traces are made for (kernels/target.py)",
            include_in_trace_context=True,
        )
    except (ImportError, AttributeError, TypeError):
        return None


_STATE = _make_state()
_FALLBACK: contextvars.ContextVar[str] = contextvars.ContextVar("target", default="")


def _encoded() -> str:
    return _STATE.value if _STATE is not None else _FALLBACK.get()


def current() -> Target | None:
    """The ahead-of-time target set by `compiling_for`, or None (trace for this process)."""
    value = _encoded()
    if not value:
        return None
    name, _, cc = value.partition(":")
    return Target(name, int(cc) if cc else None)


def platform() -> str:
    """The platform the program being traced will run on."""
    target = current()
    return target.platform if target is not None else jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform_name: str, compute_capability: int | None = None):
    """Traces inside this block are for `platform_name` (e.g. "gpu", 90), not this process."""
    value = platform_name + (f":{compute_capability}" if compute_capability is not None else "")
    if _STATE is not None:
        with _STATE(value):
            yield
        return
    token = _FALLBACK.set(value)
    try:
        yield
    finally:
        _FALLBACK.reset(token)
