"""glibc_malloc: limit_arenas caps glibc's arenas in the process that calls it (seen in a child:
a thread pool then allocates from at most 2 arenas) and leaves a user's MALLOC_ARENA_MAX alone;
release hands the free pages inside the heap back to the kernel (the child's RSS drops by what
it freed, which glibc alone keeps resident); a pipeline run calls it before every train step
unless trim_host_memory is off."""

import os
import subprocess
import sys
import textwrap

import pytest

from pipelinerl_jax import glibc_malloc, pipeline, presets

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

ARENAS_CHILD = textwrap.dedent(
    """
    import ctypes, sys, threading
    from pipelinerl_jax import glibc_malloc
    did = glibc_malloc.limit_arenas() if sys.argv[1] == "limit" else None
    libc = ctypes.CDLL("libc.so.6")
    blocks = []
    def work():  # each thread allocates while the others do: glibc spreads them over arenas
        for _ in range(200):
            blocks.append(libc.malloc(1 << 16))
    threads = [threading.Thread(target=work) for _ in range(16)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    # malloc_info's XML names one <heap nr="..."> per arena.
    libc.open_memstream.restype = ctypes.c_void_p
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    print(did, buf.value.decode().count("<heap nr="))
    """
)

# 3000 blocks of 64 KiB (below glibc's mmap threshold: they come from the heap), each written
# so its pages are resident; all but the last are freed. The last keeps the heap's top in use,
# so glibc's own trimming of the top returns nothing: ~190 MB of free pages stay resident
# until release().
RELEASE_CHILD = textwrap.dedent(
    """
    import ctypes, random
    from pipelinerl_jax import glibc_malloc
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = (ctypes.c_void_p,)
    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
    size = 1 << 16
    blocks = [libc.malloc(size) for _ in range(3000)]
    for b in blocks:
        ctypes.memset(b, random.randrange(1, 256), size)
    for b in blocks[:-1]:
        libc.free(b)
    before = rss()
    did = glibc_malloc.release()
    print(did, before - rss())
    """
)


def _child(code, *args, env=None):
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        check=True,
    ).stdout.split()


@glibc
def test_limit_arenas_caps_the_arenas_and_respects_the_users_setting():
    did, capped = _child(ARENAS_CHILD, "limit")
    assert did == "True" and int(capped) <= 2
    _, free = _child(ARENAS_CHILD, "none")
    assert int(free) > 2  # without the cap the threads spread over more arenas
    did, _ = _child(ARENAS_CHILD, "limit", env={"MALLOC_ARENA_MAX": "4"})
    assert did == "False"  # the user's setting wins


@glibc
def test_release_returns_the_free_pages_inside_the_heap():
    did, dropped = _child(RELEASE_CHILD)
    assert did == "True"
    assert int(dropped) > 150 * 2**20  # of ~190 MB freed and still resident before


@pytest.mark.parametrize("trim", [True, False])
def test_a_run_releases_before_every_train_step_unless_told_not_to(tmp_path, monkeypatch, trim):
    """...after the last publish's preparation has ended (its copies are freed by then)."""
    from pipelinerl_jax.pipeline.weights import Publisher

    calls = []
    wait = Publisher.wait_prepared

    def waited(self):
        wait(self)
        calls.append("wait")

    monkeypatch.setattr(Publisher, "wait_prepared", waited)
    monkeypatch.setattr(glibc_malloc, "release", lambda: calls.append("release") or True)
    cfg = presets.tiny(steps=3, checkpoint_every=0, eval_every=0, trim_host_memory=trim)
    assert pipeline.run(cfg, tmp_path / "run")["steps"] == 3
    assert calls == (["wait", "release"] * 3 if trim else [])
