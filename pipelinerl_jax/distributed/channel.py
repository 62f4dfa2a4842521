"""Ordered one-way message queues between processes, over jax.distributed's key-value store.

Rollouts and requests are small (token ids, logprobs, versions: a few KB per attempt), and the
coordinator service's key-value store that every jax.distributed process already talks to
carries far more than that (docs/cpu_measurements.md#key-value-store): enough, with no
second transport to open, secure or supervise. A
queue is a key prefix; message k is the key "<prefix>/<k>", written once by the one sender
(the store refuses to overwrite, so a message is never replaced) and deleted by the one
receiver after reading, so the store holds only what is in flight. Order and exactly-once
delivery follow from the counters: the sender numbers from 0, the receiver reads k, k+1, ...
until a key is missing.
"""

from __future__ import annotations

import json
from typing import Any


def kv_client():
    """This process's jax.distributed key-value client (initialize must have run)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "jax.distributed is not initialized: call distributed.runtime.initialize first"
        )
    return client


def missing(error: Exception) -> bool:
    """Whether a key-value error only says the key is not there (yet)."""
    text = str(error)
    return "NOT_FOUND" in text or "DEADLINE_EXCEEDED" in text


def try_get(client, key: str) -> str | None:
    """The value at `key`, or None when it is not set; never blocks."""
    try:
        return client.key_value_try_get(key)
    except Exception as e:
        if missing(e):
            return None
        raise


def wait_get(client, key: str, timeout_s: float) -> str | None:
    """The value at `key` once it is set, or None after `timeout_s` (the GIL is released)."""
    try:
        return client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
    except Exception as e:
        if missing(e):
            return None
        raise


class Sender:
    """Writes JSON messages to one queue; only one process may send on a prefix."""

    def __init__(self, prefix: str, client=None):
        self.prefix, self.client, self.sent = prefix, client or kv_client(), 0

    def send(self, message: Any) -> None:
        text = json.dumps(message, default=_plain)
        self.client.key_value_set(f"{self.prefix}/{self.sent}", text)
        self.sent += 1


class Receiver:
    """Reads one queue in order; only one process may receive on a prefix."""

    def __init__(self, prefix: str, client=None):
        self.prefix, self.client, self.received = prefix, client or kv_client(), 0

    def poll(self, limit: int = 1 << 30) -> list[Any]:
        """Every message that has arrived (at most `limit`), oldest first; never blocks."""
        out = []
        while len(out) < limit:
            key = f"{self.prefix}/{self.received}"
            text = try_get(self.client, key)
            if text is None:  # nothing more yet
                break
            self.client.key_value_delete(key)
            self.received += 1
            out.append(json.loads(text))
        return out


def _plain(value):
    """numpy scalars (a sampler's token ids and f32 logprobs) as exact Python numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def set_value(key: str, value: Any, client=None) -> None:
    """A small shared value anyone may overwrite (a process's version, the stop flag)."""
    (client or kv_client()).key_value_set(key, json.dumps(value), allow_overwrite=True)


def get_value(key: str, default: Any = None, client=None) -> Any:
    """The value at `key`, or `default` when it was never set; never blocks."""
    text = try_get(client or kv_client(), key)
    return default if text is None else json.loads(text)
