"""Asynchronous weight publication from the trainer to the sampler.

After every optimizer step the trainer calls `publish(params, version)`, which runs the
sampler's `prepare` (protocol.Sampler.prepare: for PagedSampler, the copy onto the sampler's
shardings and the conversion to its per-layer decode layout) at once, still in the trainer
thread. Both are dispatched, not waited for (`jax.device_put` and jitted calls are
asynchronous), and the result never aliases the trainer's buffers, because the next train step
donates them. The sampler thread calls `take_newer(version)` at each chunk boundary: a
reference swap, no recompilation (same shardings every version) and no wait, since the decode
chunk that consumes the new params simply depends on the copy on the device.

Only the newest staged version is kept: if the trainer outruns the sampler, intermediate
versions are skipped (their tokens would never exist anyway), which bounds the memory held by
staged copies to one extra params pytree on the sampler devices. In deterministic mode
(`keep_all`, pipeline/determinism.py) the sampler takes every version in order, so each is
kept until taken (`take_version`): at most max_lag + 1 copies, since the trainer cannot run
more steps ahead of the sampler's version than the lag bound allows.
"""

import dataclasses
import threading
import time

import jax


@dataclasses.dataclass
class Staged:
    """Params already prepared (or being prepared) for the sampler: set_params(prepared=True)."""

    params: object
    version: int
    staged_at: float  # time.perf_counter() when publication was dispatched


class Publisher:
    """Single-slot mailbox between the trainer thread and the sampler thread."""

    def __init__(
        self,
        prepare,
        *,
        publishes=lambda version: True,
        swap_when_ready: bool = True,
        keep_all: bool = False,
    ):
        """prepare: the sampler's `prepare` (params -> a private, sampler-ready copy);
        publishes: which versions go to the sampler; swap_when_ready: see take_newer."""
        # On separate devices a swap waits until the copy has landed, so decoding never waits
        # for the train step. Where both roles share the devices their work is serialised
        # anyway; handing the params over at once lets swaps land mid-sequence there too.
        self.swap_when_ready = swap_when_ready
        self._prepare = prepare
        self._publishes = publishes
        self._lock = threading.Lock()
        self._staged: Staged | None = None
        self.keep_all = keep_all
        self._kept: dict[int, Staged] = {}  # keep_all: published, not yet taken
        self._preparing = None  # the last published params until wait_prepared sees them done
        self.published = 0
        self.skipped = 0  # versions replaced before the sampler took them

    def publish(self, params, version: int) -> bool:
        """Prepares `params` for the sampler (async) and stages them; False if filtered."""
        if not self._publishes(version):
            return False
        t0 = time.perf_counter()
        staged = Staged(params=self._prepare(params), version=version, staged_at=t0)
        with self._lock:
            self._preparing = staged.params
            self.published += 1
            if self.keep_all:
                self._kept[version] = staged
                return True
            if self._staged is not None:
                self.skipped += 1
            self._staged = staged
        return True

    def wait_prepared(self) -> None:
        """Blocks until the last published params are prepared, then forgets them.

        A preparation (the sampler's copy and its conversion) runs asynchronously after
        publish returns, and its transient copies are freed when it ends: the trainer waits
        for that before handing free heap pages back to the kernel (glibc_malloc.release),
        or the next step starts on top of pages those copies freed a moment later."""
        with self._lock:
            params, self._preparing = self._preparing, None
        if params is not None:
            jax.block_until_ready(params)

    def take_version(self, version: int) -> Staged | None:
        """keep_all: the params of exactly `version` once published (older ones are dropped),
        else None."""
        with self._lock:
            staged = self._kept.pop(version, None)
            if staged is not None:
                for older in [v for v in self._kept if v < version]:
                    del self._kept[older]
            return staged

    def take_newer(self, current_version: int, *, when_ready: bool | None = None) -> Staged | None:
        """The staged params if they are newer than `current_version`, else None.

        With `when_ready` the params are handed over only once every leaf has arrived (the
        train step that produced them is done; a leaf without `is_ready`, e.g. a host array,
        counts as arrived): taking them earlier would make the next decode chunk wait for the
        trainer, stalling generation.
        """
        if when_ready is None:
            when_ready = self.swap_when_ready
        with self._lock:
            staged = self._staged
            if staged is None or staged.version <= current_version:
                return None
            if when_ready and not all(_ready(x) for x in jax.tree.leaves(staged.params)):
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


def _ready(leaf) -> bool:
    """Whether a staged leaf has arrived: a device array once its copy is done; anything
    without `is_ready` (a host array a proxy sampler produced) at once."""
    is_ready = getattr(leaf, "is_ready", None)
    return is_ready() if is_ready is not None else True
