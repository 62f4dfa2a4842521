"""malloc_arenas.limit caps glibc's arenas in the process that calls it (seen in a child: a
thread pool then allocates from at most 2 arenas) and leaves a user's MALLOC_ARENA_MAX alone."""

import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import ctypes, sys, threading
    from pipelinerl_jax import malloc_arenas
    did = malloc_arenas.limit() if sys.argv[1] == "limit" else None
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


def _arenas(mode, env=None):
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        check=True,
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_limit_caps_the_arenas_and_respects_the_users_setting():
    did, capped = _arenas("limit")
    assert did == "True" and capped <= 2
    _, free = _arenas("none")
    assert free > 2  # without the cap the threads spread over more arenas
    did, _ = _arenas("limit", {"MALLOC_ARENA_MAX": "4"})
    assert did == "False"  # the user's setting wins
