"""Compilation, made visible and paid once: the persistent cache, a counter, a progress line.

A real model compiles for about a minute on 2 CPU cores before its first step (the decode
chunk, the prefill shapes, the train step). Three things keep that from being a silent minute
that recurs on every launch:

- `enable_persistent_cache(dir)`: JAX's own on-disk compilation cache, so a relaunch or a
  resume loads the executables instead of compiling them again;
- `CompileWatch`: counts the backend compilations (and cache hits) through `jax.monitoring`,
  so each step's record says how many compilations it paid for (0 after warm-up), and
- prints one line when a compilation has taken longer than `announce_after_s`, and one when it
  ends, so the console says what it is waiting for.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import jax
from jax import monitoring

from pipelinerl_jax import cli

_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # a compilation is about to start
_COMPILED = "/jax/core/compile/backend_compile_duration"  # it ended (compiled or loaded)
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def default_cache_dir() -> Path:
    """$PIPELINERL_JAX_CACHE, else $XDG_CACHE_HOME/pipelinerl_jax, else ~/.cache/pipelinerl_jax;
    compiled executables go in its `jax_compilation` folder."""
    root = os.environ.get("PIPELINERL_JAX_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "pipelinerl_jax")
    return Path(root) / "jax_compilation"


def cache_path(value: str | os.PathLike | None) -> Path:
    """The folder a config's compile_cache names: None or "auto" mean default_cache_dir()."""
    return Path(value) if value and value != "auto" else default_cache_dir()


# JAX's own variable for the shortest compilation worth storing; a value set there wins over
# ours (1 s), as any JAX user would expect.
MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def enable_persistent_cache(
    path: str | os.PathLike | None = None, min_compile_time_s: float | None = None
) -> Path:
    """Turns on JAX's persistent compilation cache in `path` (None or "auto", the config's
    value: default_cache_dir()).

    Only executables that took at least `min_compile_time_s` to compile are written (None:
    $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, else 1 s): a real model's many tiny helper
    jits would cost more to hash and store than to recompile. Processes that compile the same
    small programs over and over (the test suite's launches) set it to 0.1."""
    if min_compile_time_s is None:  # JAX parsed its variable (and refused a bad one) at import
        min_compile_time_s = (
            jax.config.jax_persistent_cache_min_compile_time_secs
            if os.environ.get(MIN_COMPILE_TIME_ENV)
            else 1.0
        )
    path = cache_path(path)
    cli.check_dir(str(path), create=True, where=f"--config.compile_cache={path}")
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_s)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class CompileWatch:
    """Counts compilations process-wide while installed; announces the long ones.

    watch = CompileWatch(echo=print).install()
    ...
    n, seconds = watch.take()      # compilations (and their seconds) since the last take()
    watch.uninstall()
    """

    def __init__(self, echo=None, announce_after_s: float = 2.0):
        self.echo = echo
        self.announce_after_s = announce_after_s
        self.count = 0  # backend compilations (cache loads included)
        self.seconds = 0.0
        self.cache_hits = 0
        self.by_name: dict[str, list[float]] = {}
        self._taken = (0, 0.0)
        self._lock = threading.Lock()
        self._timers: dict[tuple[int, str], threading.Timer] = {}
        self._announced: set[tuple[int, str]] = set()
        self._installed = False

    def install(self) -> CompileWatch:
        if not self._installed:
            monitoring.register_event_duration_secs_listener(self._on_duration)
            monitoring.register_event_listener(self._on_event)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            monitoring.unregister_event_duration_listener(self._on_duration)
            monitoring.unregister_event_listener(self._on_event)
            self._installed = False
        with self._lock:
            for timer in self._timers.values():
                timer.cancel()
            self._timers.clear()

    def take(self) -> tuple[int, float]:
        """(compilations, seconds) since the previous take()."""
        with self._lock:
            n0, s0 = self._taken
            self._taken = (self.count, self.seconds)
            return self.count - n0, self.seconds - s0

    # --- listeners (called in the compiling thread) -------------------------------------

    def _on_event(self, event: str, **_) -> None:
        if event == _CACHE_HIT:
            with self._lock:
                self.cache_hits += 1

    def _on_duration(self, event: str, duration: float, fun_name: str = "?", **_) -> None:
        key = (threading.get_ident(), fun_name)
        if event == _LOWERED and self.echo is not None and self.announce_after_s >= 0:
            timer = threading.Timer(self.announce_after_s, self._announce, (key, time.time()))
            timer.daemon = True
            with self._lock:
                old = self._timers.pop(key, None)
                self._timers[key] = timer
            if old is not None:
                old.cancel()
            timer.start()
        elif event == _COMPILED:
            with self._lock:
                self.count += 1
                self.seconds += duration
                self.by_name.setdefault(fun_name, []).append(duration)
                timer = self._timers.pop(key, None)
                announced = key in self._announced
                self._announced.discard(key)
            if timer is not None:
                timer.cancel()
            if announced:
                self.echo(f"compiled {_short(fun_name)} in {duration:.1f}s")

    def _announce(self, key, _started) -> None:
        with self._lock:
            if self._timers.get(key) is None:
                return
            self._announced.add(key)
        self.echo(
            f"compiling {_short(key[1])} (first use of this shape; later launches load "
            "it from the compilation cache) ..."
        )


def _short(fun_name: str) -> str:
    """'jit(_decode_chunk)' -> '_decode_chunk'."""
    return fun_name[4:-1] if fun_name.startswith("jit(") and fun_name.endswith(")") else fun_name
