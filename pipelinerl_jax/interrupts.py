"""Ctrl-C that is never lost: SIGINT raises KeyboardInterrupt, and again until someone has it.

Python runs a signal handler between two bytecodes of the main thread, wherever it is. When
that is inside a garbage-collector callback (jax registers one) or a `__del__`, the
KeyboardInterrupt is printed as "Exception ignored" and dropped, and the process runs on as
if nothing happened: a multi-process run then never stopped. So after a SIGINT a guard
thread delivers the interrupt again (`_thread.interrupt_main`) every `RETRY_S` until a
handler says it has it (`received()`), at most `RETRIES` times.
"""

from __future__ import annotations

import _thread
import signal
import threading
import time

RETRY_S = 1.0
RETRIES = 10

_lock = threading.Lock()
_pending = False  # a SIGINT arrived and no handler has said it received it


def _deliver_again(retry_s: float, retries: int) -> None:
    global _pending
    for _ in range(retries):
        time.sleep(retry_s)
        with _lock:
            if not _pending:
                return
        _thread.interrupt_main(signal.SIGINT)  # runs _on_sigint again in the main thread
    with _lock:
        _pending = False


def _on_sigint(signum, frame):
    global _pending
    with _lock:
        first = not _pending
        _pending = True
    if first:
        threading.Thread(
            target=_deliver_again, args=(RETRY_S, RETRIES), name="sigint-guard", daemon=True
        ).start()
    raise KeyboardInterrupt


def install() -> None:
    """SIGINT -> KeyboardInterrupt in the main thread, delivered until `received()`."""
    signal.signal(signal.SIGINT, _on_sigint)


def received() -> None:
    """Called where a KeyboardInterrupt is caught: stops the guard re-delivering it."""
    global _pending
    with _lock:
        _pending = False
