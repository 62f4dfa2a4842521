"""The trainer end of weight publication (the protocol: weights.py)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid as uuid_lib
from collections.abc import Sequence
from typing import Any

import jax

from pipelinerl_jax.distributed.channel import kv_client
from pipelinerl_jax.distributed.channel import wait_get as _wait_get
from pipelinerl_jax.distributed.weights import (
    PREFIX,
    TRANSFER_SIZE,
    WAKE_KEEP,
    delete,
    spec_hash,
    spec_of,
    start_transfer_server,
)


@dataclasses.dataclass
class _Offer:
    """One published version as the server holds it."""

    version: int
    leaves: list  # one single-device jax.Array per leaf, never donated
    pulling: set = dataclasses.field(default_factory=set)  # pullers whose pull is in flight
    acked: set = dataclasses.field(default_factory=set)  # pullers that hold it
    superseded: bool = False


class WeightServer:
    """The trainer process's end: publishes versions, answers claims, frees what is done.

    pullers: the process ids of the sampler processes expected to pull every version (an
    elastic run starts with none: each sampler registers its own puller name, under
    `pullers/<name>`, and the trainer removes the ones it lost, `remove_puller`);
    device: where offered copies live (default: this process's first local device);
    host: the address peers reach this process at (default: the interface that routes to the
    jax.distributed coordinator); transfer_size: bytes per transfer chunk.
    """

    def __init__(
        self,
        pullers: Sequence[int],
        *,
        device=None,
        host: str | None = None,
        transfer_size: int = TRANSFER_SIZE,
        prefix: str = PREFIX,
        client=None,
        wait_s: float = 0.5,
        keep_latest: bool = False,
    ):
        # keep_latest: the newest version stays offered even once every puller has it, so a
        # sampler that joins later can pull it (an elastic run); else it is freed then.
        self.keep_latest = keep_latest
        self.pullers: set[str] = set()
        self.prefix = prefix
        self._client = client or kv_client()
        self._device = device or jax.local_devices()[0]
        self._sharding = jax.sharding.SingleDeviceSharding(self._device)
        self._server = start_transfer_server(self._device, host, transfer_size)
        self.address = self._server.address()
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._live: dict[int, _Offer] = {}
        self._last_version: int | None = None
        self._spec_key: tuple | None = None  # (treedef, shapes, dtypes) of the last publish
        self._spec_text: str | None = None
        self._spec_hash: str | None = None
        self._pending: dict | None = None  # the announcement the announcer has not written
        self._pending_spec: tuple[str, str] | None = None
        self._error: BaseException | None = None
        self._stop = False
        self.stats = {
            "published": 0,
            "claims": 0,  # claims answered with an offer
            "refused": 0,  # claims for a version already dropped
            "acked": 0,
            "failed_pulls": 0,
            "freed": 0,
            "dropped_unpulled": 0,  # superseded before anyone pulled it
            "published_during_pull": 0,  # publishes while some pull was in flight
            "max_live": 0,
            "publish_max_s": 0.0,
        }
        self._threads = [
            threading.Thread(target=self._announce, name="weights-announce", daemon=True),
            threading.Thread(target=self._roster, name="weights-roster", daemon=True),
        ]
        for t in self._threads:
            t.start()
        for p in pullers:
            self.add_puller(str(p))

    def add_puller(self, name: str) -> None:
        """Expects `name` to pull every version from now on (a thread answers its claims)."""
        with self._lock:
            if name in self.pullers or self._stop:
                return
            self.pullers.add(name)
        t = threading.Thread(target=self._serve, args=(name,), name=f"weights-puller-{name}")
        t.daemon = True
        self._threads.append(t)
        t.start()

    def remove_puller(self, name: str) -> None:
        """Stops expecting `name` (a sampler process that is gone): its claims in flight are
        dropped, and versions it alone held are freed."""
        with self._lock:
            self.pullers.discard(name)
            for offer in list(self._live.values()):
                offer.pulling.discard(name)
                if offer.superseded and not offer.pulling:
                    self._free(offer)

    # --- trainer thread ---------------------------------------------------------------------

    def publish(self, params: Any, version: int, *, copy: bool = True) -> None:
        """Offers `params` as `version` to every puller; returns at once (nothing waits).

        copy=True places a private copy on the server's device (dispatched, not waited for),
        since the trainer donates its buffers to its next step; copy=False takes `params` as
        they are (only for a copy nobody else will donate or modify).
        """
        t0 = time.perf_counter()
        if self._error is not None:
            raise RuntimeError(f"weight server failed: {self._error}") from self._error
        version = int(version)
        if self._last_version is not None and version <= self._last_version:
            raise RuntimeError(
                f"publish(version={version}) after version {self._last_version}: versions "
                "must increase (samplers tag tokens with them)"
            )
        leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        leaves = [x for _, x in leaves_with_paths]
        key = (treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
        if key != self._spec_key:
            spec = spec_of(leaves_with_paths)
            self._spec_key, self._spec_text = key, json.dumps(spec)
            self._spec_hash = spec_hash(spec)
        placed = jax.device_put(leaves, self._sharding, may_alias=False if copy else None)
        with self._lock:
            self._last_version = version
            if any(o.pulling for o in self._live.values()):
                self.stats["published_during_pull"] += 1
            for old in list(self._live.values()):
                old.superseded = True
                if not old.pulling:
                    if not old.acked:
                        self.stats["dropped_unpulled"] += 1
                    self._free(old)
            self._live[version] = _Offer(version=version, leaves=placed)
            self.stats["published"] += 1
            self.stats["max_live"] = max(self.stats["max_live"], len(self._live))
            self._pending = {
                "version": version,
                "address": self.address,
                "spec": self._spec_hash,
                "server": jax.process_index(),
            }
            self._pending_spec = (self._spec_hash, self._spec_text)
            self._wake.notify_all()
        self.stats["publish_max_s"] = max(self.stats["publish_max_s"], time.perf_counter() - t0)

    @property
    def live_versions(self) -> int:
        """How many published versions the server still holds buffers for."""
        with self._lock:
            return len(self._live)

    def pulls_in_flight(self) -> int:
        """How many claimed pulls have not been reported done."""
        with self._lock:
            return sum(len(o.pulling) for o in self._live.values())

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until every live version is acked by every puller (live_versions == 0), up to
        `timeout_s`; True if it got there. For a clean shutdown and for tests."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.live_versions == 0:
                return True
            time.sleep(0.01)
        return self.live_versions == 0

    def close(self) -> None:
        """Stops the background threads (within `wait_s`) and drops every offered copy. The
        transfer server itself lives until the process exits (jax has no call to stop it)."""
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        for t in self._threads:
            t.join(timeout=self._wait_s + 5.0)
        with self._lock:
            self._live.clear()

    # --- background threads -----------------------------------------------------------------

    def _free(self, offer: _Offer) -> None:  # holds self._lock
        if self._live.pop(offer.version, None) is not None:
            self.stats["freed"] += 1

    def _announce(self) -> None:
        """Writes announcements in the store, off the trainer thread; only the newest of
        several pending ones is written (a skipped version is never pulled)."""
        spec_written: set[str] = set()
        n = 0
        try:
            while True:
                with self._lock:
                    while self._pending is None and not self._stop:
                        self._wake.wait()
                    if self._stop:
                        return
                    message, self._pending = self._pending, None
                    spec_hash, spec_text = self._pending_spec
                if spec_hash not in spec_written:
                    self._client.key_value_set(
                        f"{self.prefix}/spec/{spec_hash}", spec_text, allow_overwrite=True
                    )
                    spec_written.add(spec_hash)
                message["n"] = n
                self._client.key_value_set(
                    f"{self.prefix}/latest", json.dumps(message), allow_overwrite=True
                )
                self._client.key_value_set(f"{self.prefix}/wake/{n}", "1", allow_overwrite=True)
                if n >= WAKE_KEEP:
                    delete(self._client, f"{self.prefix}/wake/{n - WAKE_KEEP}")
                n += 1
        except Exception as e:  # surfaced by the next publish()
            if not self._stop:
                self._error = e

    def _roster(self) -> None:
        """Adds the pullers that registered themselves (WeightClient(puller=...))."""
        try:
            while not self._stop:
                for key, _ in self._client.key_value_dir_get(f"{self.prefix}/pullers/"):
                    name = key.rsplit("/", 1)[-1]
                    if name not in self.pullers:
                        self.add_puller(name)
                time.sleep(self._wait_s)
        except Exception as e:
            if not self._stop:
                self._error = e

    def _serve(self, puller: str) -> None:
        """Answers puller `puller`'s claims and acks, in order, until it is removed."""
        k = 0
        try:
            while not self._stop and puller in self.pullers:
                key = f"{self.prefix}/to_server/{puller}/{k}"
                text = _wait_get(self._client, key, self._wait_s)
                if text is None:
                    continue
                delete(self._client, key)
                message = json.loads(text)
                if message["op"] == "claim":
                    reply = self._claim(puller, int(message["version"]))
                    self._client.key_value_set(
                        f"{self.prefix}/to_client/{puller}/{k}", json.dumps(reply)
                    )
                else:
                    self._done(puller, int(message["version"]), bool(message["ok"]))
                k += 1
        except Exception as e:
            if not self._stop:
                self._error = e

    def _claim(self, puller: str, version: int) -> dict:
        with self._lock:
            offer = self._live.get(version)
            if offer is None:
                self.stats["refused"] += 1
                return {"ok": False}
            # A fresh id per (version, puller): the transfer server serves one pull per id.
            uuid = uuid_lib.uuid4().int >> 65
            self._server.await_pull(uuid, offer.leaves)
            offer.pulling.add(puller)
            self.stats["claims"] += 1
            return {"ok": True, "uuid": uuid}

    def _done(self, puller: str, version: int, ok: bool) -> None:
        with self._lock:
            offer = self._live.get(version)
            if offer is None:
                return
            offer.pulling.discard(puller)
            if ok:
                offer.acked.add(puller)
                self.stats["acked"] += 1
            else:
                self.stats["failed_pulls"] += 1
            every = offer.acked.issuperset(self.pullers)
            if (every and not self.keep_latest) or (offer.superseded and not offer.pulling):
                self._free(offer)
