"""A failure in one process ends every process of the run, with one line naming it.

Under the supervisor (`--spawn_local`) the supervisor does this. On separate hosts there is
none, and JAX alone only notices a dead peer at the heartbeat timeout, then aborts the others
with a native stack dump that names nobody. So each process of a multi-process run reports
its own exception (Ctrl-C included) under one key of the jax.distributed key-value store,
and watches that key from a daemon thread: the first report from another process is printed
as one line on stderr and this process exits at once with code 1. A process killed outright
cannot report; its peers end at the 10 s heartbeat (runtime.initialize).
"""

from __future__ import annotations

import os
import sys
import threading

from pipelinerl_jax.distributed import channel

KEY = "pipelinerl/failed"


def one_line(spec, error: BaseException) -> str:
    """ "process 2 (sampler 1): ValueError: ..." (the first line of the message)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{spec.name}: {type(error).__name__}" + (f": {text}" if text else "")


def report(spec, error: BaseException, client=None) -> None:
    """Records this process's failure for the others (the first report stays)."""
    client = client or channel.kv_client()
    try:
        client.key_value_set(KEY, one_line(spec, error))
    except Exception:
        pass  # another process reported first (ALREADY_EXISTS), or the store is gone


def watch(spec, *, poll_s: float = 1.0, client=None, exit=os._exit) -> threading.Thread:
    """Starts the daemon thread that ends this process when another one reports a failure."""
    client = client or channel.kv_client()

    def run():
        while True:
            try:
                line = channel.wait_get(client, KEY, poll_s)
            except Exception:
                return  # the store is gone: the run is ending anyway
            if line is not None and not line.startswith(f"{spec.name}:"):
                print(f"stopping: {line}", file=sys.stderr, flush=True)
                exit(1)
                return
            if line is not None:
                return  # our own report: the main thread is already on its way out

    thread = threading.Thread(target=run, name="failure-watch", daemon=True)
    thread.start()
    return thread
