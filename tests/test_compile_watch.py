"""compile_watch: compilations counted per take(), long ones announced, and the persistent
cache written by one process and loaded by the next (each in its own process: the cache is a
process-wide JAX setting)."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp

from pipelinerl_jax.pipeline.compile_watch import CompileWatch


def test_counts_new_shapes_only_and_announces_long_compiles():
    lines = []
    x3, y3, x5, x7 = (
        jax.random.normal(jax.random.key(i), (n,)) for i, n in enumerate((3, 3, 5, 7))
    )  # made before counting starts
    watch = CompileWatch(echo=lines.append, announce_after_s=0.0).install()
    try:
        f = jax.jit(lambda x: jnp.sin(x) * 2.0 + 1.0)
        f(x3).block_until_ready()
        assert watch.take()[0] == 1
        f(y3).block_until_ready()  # same shape: no compilation
        assert watch.take() == (0, 0.0)
        f(x5).block_until_ready()  # a new shape compiles again
        n, seconds = watch.take()
        assert n == 1 and seconds > 0
        assert len(watch.by_name["jit(<lambda>)"]) == 2
    finally:
        watch.uninstall()
    # announce_after_s=0: every compilation is announced, then reported when it ends.
    assert any(x.startswith("compiling <lambda>") for x in lines)
    assert any(x.startswith("compiled <lambda> in ") for x in lines)
    f(x7).block_until_ready()  # uninstalled: nothing more counted
    assert watch.count == 2


_CHILD = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp
    from pipelinerl_jax.pipeline.compile_watch import CompileWatch, enable_persistent_cache
    enable_persistent_cache(sys.argv[1], min_compile_time_s=0.0)
    watch = CompileWatch().install()
    f = jax.jit(lambda x: jnp.cumsum(jnp.tanh(x @ x.T), axis=1))
    f(jnp.ones((64, 64))).block_until_ready()
    print(watch.count, watch.cache_hits)
""")


def _child(script: str, cache, env=None) -> list[float]:
    """Runs `script` with the cache folder as its argument; the numbers it printed."""
    out = subprocess.run(
        [sys.executable, "-c", script, str(cache)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    return [float(v) for v in out.stdout.split()]


def test_persistent_cache_is_loaded_by_the_next_process(tmp_path):
    count, hits = _child(_CHILD, tmp_path / "cache")
    assert count >= 1 and hits == 0
    assert any((tmp_path / "cache").iterdir())  # executables were written
    count, hits = _child(_CHILD, tmp_path / "cache")
    assert hits >= 1  # ... and loaded, not compiled again


def test_auto_and_none_mean_the_default_cache_dir(monkeypatch, tmp_path):
    """The config's "auto" is the user cache dir, never a folder named "auto" in the cwd."""
    from pipelinerl_jax.pipeline import compile_watch

    set_to = {}
    monkeypatch.setattr(
        compile_watch.jax.config, "update", lambda key, value: set_to.__setitem__(key, value)
    )
    monkeypatch.setattr(compile_watch, "default_cache_dir", lambda: tmp_path / "default")
    monkeypatch.chdir(tmp_path)
    for value in ("auto", None):
        assert compile_watch.enable_persistent_cache(value) == tmp_path / "default"
        assert set_to["jax_compilation_cache_dir"] == str(tmp_path / "default")
    assert not (tmp_path / "auto").exists()
    assert compile_watch.enable_persistent_cache(tmp_path / "mine") == tmp_path / "mine"


_MIN_TIME_CHILD = textwrap.dedent("""
    import sys, jax
    from pipelinerl_jax.pipeline.compile_watch import enable_persistent_cache
    key = "jax_persistent_cache_min_compile_time_secs"
    enable_persistent_cache(sys.argv[1])
    print(getattr(jax.config, key))
    enable_persistent_cache(sys.argv[1], min_compile_time_s=3.0)
    print(getattr(jax.config, key))
""")


def test_jax_own_variable_sets_the_shortest_compilation_stored(tmp_path):
    """JAX's $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS (the suite sets 0) wins over our 1 s;
    an explicit argument wins over both."""
    from pipelinerl_jax.pipeline.compile_watch import MIN_COMPILE_TIME_ENV

    def child(value):
        env = {k: v for k, v in os.environ.items() if k != MIN_COMPILE_TIME_ENV}
        if value is not None:
            env[MIN_COMPILE_TIME_ENV] = value
        return _child(_MIN_TIME_CHILD, tmp_path / "cache", env)

    assert child(None) == [1.0, 3.0]
    assert child("0.25") == [0.25, 3.0]
