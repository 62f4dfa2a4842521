"""Asynchronous weight publication from the trainer mesh to the sampler mesh.

After every optimizer step the trainer calls `publish(params, version)`. The copy onto the
sampler's shardings is dispatched at once (`jax.device_put` is asynchronous) and never
aliases the trainer's buffers, because the next train step donates them. `prepare` (the
sampler's conversion to its per-layer decode layout) is dispatched right after, still in the
trainer thread, so the sampler's chunk boundary only swaps a reference. The sampler calls
`take_newer(version)` at each chunk boundary: a reference swap, no recompilation (same
shardings every version) and no wait, since the decode chunk that consumes the new params
simply depends on the copy on the device.

Only the newest staged version is kept: if the trainer outruns the sampler, intermediate
versions are skipped (their tokens would never exist anyway), which bounds the memory held by
staged copies to one extra params pytree on the sampler devices.
"""

import dataclasses
import threading
import time

import jax


@dataclasses.dataclass
class Staged:
    """A params pytree already placed (or being placed) on the sampler devices."""

    params: object
    version: int
    staged_at: float  # time.perf_counter() when publication was dispatched
    prepared: bool = False  # params went through the publisher's `prepare` already


class Publisher:
    """Single-slot mailbox between the trainer thread and the sampler thread."""

    def __init__(
        self,
        sampler_shardings,
        *,
        prepare=None,
        publishes=lambda version: True,
        swap_when_ready: bool = True,
    ):
        # On separate devices a swap waits until the copy has landed, so decoding never waits
        # for the train step. Where both roles share the devices their work is serialised
        # anyway; handing the params over at once lets swaps land mid-sequence there too.
        self.swap_when_ready = swap_when_ready
        self._shardings = sampler_shardings
        self._prepare = prepare
        self._publishes = publishes
        self._lock = threading.Lock()
        self._staged: Staged | None = None
        self.published = 0
        self.skipped = 0  # versions replaced before the sampler took them

    def publish(self, params, version: int) -> bool:
        """Copies `params` to the sampler devices (async) and stages them; False if filtered."""
        if not self._publishes(version):
            return False
        t0 = time.perf_counter()
        copy = jax.device_put(params, self._shardings, may_alias=False)
        if self._prepare is not None:
            copy = self._prepare(copy)
        staged = Staged(
            params=copy, version=version, staged_at=t0, prepared=self._prepare is not None
        )
        with self._lock:
            if self._staged is not None:
                self.skipped += 1
            self._staged = staged
            self.published += 1
        return True

    def take_newer(self, current_version: int, *, when_ready: bool | None = None) -> Staged | None:
        """The staged params if they are newer than `current_version`, else None.

        With `when_ready` the params are handed over only once every leaf has arrived on the
        sampler devices (the train step that produced them is done): taking them earlier
        would make the next decode chunk wait for the trainer, stalling generation.
        """
        if when_ready is None:
            when_ready = self.swap_when_ready
        with self._lock:
            staged = self._staged
            if staged is None or staged.version <= current_version:
                return None
            if when_ready and not all(x.is_ready() for x in jax.tree.leaves(staged.params)):
                return None
            self._staged = None
            return staged

    def wait_newer(self, current_version: int, timeout: float) -> Staged | None:
        """Like take_newer, polling up to `timeout` s (used when the sampler has nothing to do)."""
        deadline = time.perf_counter() + timeout
        while True:
            staged = self.take_newer(current_version, when_ready=False)
            if staged is not None or time.perf_counter() >= deadline:
                return staged
            time.sleep(0.001)
