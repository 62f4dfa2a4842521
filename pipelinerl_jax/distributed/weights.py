"""Weight versions from the trainer process to sampler processes, each pulled at its own pace.

The trainer calls `WeightServer.publish(params, version)` after an optimizer step; every
sampler process calls `WeightClient.poll()` between two decode chunks and gets the newest
version it does not have yet, as `(params, version)`, or None. Per-token versions stay exact:
the version a client returns is the one the server published with those very buffers (one
transfer id per version and puller, never reused).

Mechanism: `jax.experimental.transfer`. The trainer process runs a transfer server; a sampler
pulls the offered buffers over its own connection, whenever it is ready, without the trainer
doing anything but answering a small claim. The alternative, a cross-process
`jax.device_put`, is a collective: every process must issue the same puts in the same order,
and a collective that follows before the receiver took part deadlocks, so samplers could not
pull at their own chunk boundaries. Small messages (announcements, claims, acks) go through the
jax.distributed key-value store (~12 MB/s here, plenty for a few hundred bytes per version).
Measured between two CPU processes on the 2-core machine (bench/bench_weight_transfer.py,
bench/results/weight_transfer.json): a pull moves ~0.9 GB/s with `transfer_size` chunks of
4 MiB, for the 232 MB bench model and the 540 MB SmolLM2-135M alike; jax's default 256 MiB
chunks gave the same for the bench model and half (0.46 GB/s) for SmolLM2, whose 113 MB
embedding is one chunk. Each transfer server also maps 2 x 8 chunks of host memory up front
(pinned on a GPU): 64 MiB with 4 MiB chunks, 4 GiB with the default. Hence 4 MiB here.

Protocol (keys under `prefix`, "pipelinerl/weights" by default):

    latest                  {"version", "n", "address", "spec", "server"}: newest announcement
    wake/<n>                set after announcement n, so clients block instead of polling
    spec/<hash>             the leaves' paths, shapes and dtypes (written once per layout)
    to_server/<p>/<k>       puller p's k-th message: {"op": "claim" | "done", "version", ...}
    to_client/<p>/<k>       the server's answer to claim k: {"ok": true, "uuid"} | {"ok": false}

A puller claims a version before pulling it. The server offers the buffers to that one puller
(`await_pull` with a fresh uuid) only then, so a version nobody claimed is never registered
with the transfer server and can be dropped the moment a newer one is published; a claim for a
dropped version is refused and the puller reads `latest` again. A claimed version stays alive
until its puller reports the pull done, even if newer ones were published meanwhile. A version
is freed once every expected puller has acknowledged it, or once it is superseded and no pull
of it is in progress; `WeightServer.live_versions` counts those still held. Each queue has one
writer and one reader, who deletes what it read, so the store holds only what is in flight.

Layout: buffers travel as one buffer per leaf on one device at each end (source and
destination of a transfer must have the same layout); a client given a sharded target
re-places each leaf locally after the pull. Shapes, dtypes and leaf paths are checked against
the client's `like` before claiming: a mismatch raises a one-line ConfigError.

Threads. Server: `publish` dispatches a private device copy and hands the announcement to a
background thread (measured: 1-4 ms for 11 MB, 5-13 ms for 232-540 MB, since XLA's CPU client
runs part of the copy inline); the copy is dispatched before `publish` returns because the
trainer's next step donates the buffers it reads. One background thread per expected puller
answers claims and acks (blocking reads of the store, GIL released), and the transfer
server's own threads send the bytes. Client: with `background=True` (the default) a thread
watches for announcements, claims, pulls, waits until the bytes have landed, acks, and leaves
the result in a one-slot mailbox; `poll()` only takes it (a lock and a reference), so the
sampler swaps at its chunk boundary and never waits for the network. The thread pulls the next
version only after `poll()` took the previous one: at most one pulled copy waits beside the
params in use. With `background=False`, `poll()` does the same work itself and blocks for the
pull.

Limits: a puller that dies between its claim and its report keeps that one version alive on
the server (its offer stays registered with the transfer server, which has no call to
withdraw one). One WeightServer per prefix per run and one WeightClient per process per prefix
(the message counters start at 0 and are not renegotiated): a restarted sampler process needs
a new prefix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import threading
import time
import uuid as uuid_lib
from collections.abc import Sequence
from typing import Any

import jax

from pipelinerl_jax.distributed.channel import kv_client
from pipelinerl_jax.distributed.channel import missing as _missing
from pipelinerl_jax.distributed.channel import try_get as _try_get
from pipelinerl_jax.distributed.channel import wait_get as _wait_get
from pipelinerl_jax.errors import ConfigError

PREFIX = "pipelinerl/weights"
TRANSFER_SIZE = 4 << 20  # bytes per transfer chunk: 4 MiB (see the module docstring)
_WAKE_KEEP = 8  # wake/<n> keys kept; a client further behind re-reads `latest` after wait_s


def _delete(client, key: str) -> None:
    try:
        client.key_value_delete(key)
    except Exception as e:
        if not _missing(e):
            raise


def _local_host() -> str:
    """The address peers reach this process at: the interface that routes to the coordinator
    (127.0.0.1 when the coordinator is local). A UDP connect sends no packet."""
    from jax._src import distributed

    coordinator = distributed.global_state.coordinator_address or "127.0.0.1:1"
    host = coordinator.rpartition(":")[0].strip("[]") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 1))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _start_transfer_server(device, host: str | None, transfer_size: int):
    from jax.experimental import transfer

    host = host or _local_host()
    # A bulk-transport address is required between processes: without one (jaxlib 0.10.2) a
    # pull from another process aborts the serving process (a CHECK failure in socket-server).
    return transfer.start_transfer_server(
        device.client, f"{host}:0", [f"{host}:0"], transfer_size=int(transfer_size)
    )


def _spec(leaves_with_paths) -> list[list]:
    """[[path, shape, dtype], ...] of a flattened pytree: what both ends must agree on."""
    return [
        [jax.tree_util.keystr(path), [int(d) for d in x.shape], str(x.dtype)]
        for path, x in leaves_with_paths
    ]


def _spec_hash(spec: list[list]) -> str:
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def _describe(entry) -> str:
    return f"{tuple(entry[1])} {entry[2]}"


def _spec_mismatch(theirs: list[list], ours: list[list]) -> str:
    """One line saying where the trainer's leaves and this process's differ."""
    if len(theirs) != len(ours):
        return f"the trainer publishes {len(theirs)} leaves, this process expects {len(ours)}"
    for t, o in zip(theirs, ours, strict=True):
        if t[0] != o[0]:
            return f"leaf {t[0]} on the trainer is {o[0]} here"
        if t[1:] != o[1:]:
            return f"leaf {t[0]} is {_describe(t)} on the trainer but {_describe(o)} here"
    return "the layouts differ"


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

    pullers: the process ids of the sampler processes expected to pull every version;
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
    ):
        if not pullers:
            raise ConfigError("WeightServer(pullers=[]): name the sampler process ids that pull")
        self.pullers = tuple(int(p) for p in pullers)
        self.prefix = prefix
        self._client = client or kv_client()
        self._device = device or jax.local_devices()[0]
        self._sharding = jax.sharding.SingleDeviceSharding(self._device)
        self._server = _start_transfer_server(self._device, host, transfer_size)
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
        self._threads = [threading.Thread(target=self._announce, name="weights-announce")]
        self._threads += [
            threading.Thread(target=self._serve, args=(p,), name=f"weights-puller-{p}")
            for p in self.pullers
        ]
        for t in self._threads:
            t.daemon = True
            t.start()

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
            spec = _spec(leaves_with_paths)
            self._spec_key, self._spec_text = key, json.dumps(spec)
            self._spec_hash = _spec_hash(spec)
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
                if n >= _WAKE_KEEP:
                    _delete(self._client, f"{self.prefix}/wake/{n - _WAKE_KEEP}")
                n += 1
        except Exception as e:  # surfaced by the next publish()
            if not self._stop:
                self._error = e

    def _serve(self, puller: int) -> None:
        """Answers puller `puller`'s claims and acks, in order."""
        k = 0
        try:
            while not self._stop:
                key = f"{self.prefix}/to_server/{puller}/{k}"
                text = _wait_get(self._client, key, self._wait_s)
                if text is None:
                    continue
                _delete(self._client, key)
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

    def _claim(self, puller: int, version: int) -> dict:
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

    def _done(self, puller: int, version: int, ok: bool) -> None:
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
            if every or (offer.superseded and not offer.pulling):
                self._free(offer)


class WeightClient:
    """A sampler process's end: `poll()` between decode chunks returns newer weights or None.

    like: a pytree of arrays or ShapeDtypeStructs with the trainer's params' structure,
    shapes and dtypes (checked against every announcement); sharding: where the pulled params
    should live: None (on `device`), a Device, a Sharding, or a pytree of Shardings like
    `like`; device: where leaves land from the network (default: this process's first local
    device); version: the version the caller already holds (only newer ones are pulled);
    background: pull in a background thread (see the module docstring).
    """

    def __init__(
        self,
        like: Any,
        *,
        sharding: Any = None,
        device=None,
        version: int = -1,
        background: bool = True,
        host: str | None = None,
        transfer_size: int = TRANSFER_SIZE,
        prefix: str = PREFIX,
        client=None,
        claim_timeout_s: float = 60.0,
        wait_s: float = 0.5,
    ):
        self.prefix = prefix
        self._client = client or kv_client()
        self._process = jax.process_index()
        self._device = device or jax.local_devices()[0]
        leaves_with_paths, self._treedef = jax.tree_util.tree_flatten_with_path(like)
        self._spec = _spec(leaves_with_paths)
        self._spec_hash = _spec_hash(self._spec)
        self._wire, self._targets = self._placements(sharding, len(leaves_with_paths))
        self._specs = [
            jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype), sharding=wire)
            for (_, shape, dtype), wire in zip(self._spec, self._wire, strict=True)
        ]
        self._transfer = _start_transfer_server(self._device, host, transfer_size)
        self._connections: dict[str, Any] = {}
        self._claim_timeout_s, self._wait_s = claim_timeout_s, wait_s
        self._sent = 0  # messages sent to the server (the server counts the same way)
        self._have = int(version)  # newest version pulled (taken by poll() or waiting)
        self._taken = int(version)  # newest version poll() returned
        self._lock = threading.Lock()
        self._taken_cv = threading.Condition(self._lock)
        self._staged: tuple[Any, int] | None = None
        self._error: BaseException | None = None
        self._stop = False
        self.stats = {"pulls": 0, "refused": 0, "bytes": 0, "pull_s": 0.0, "skipped": 0}
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="weights-client", daemon=True)
            self._thread.start()

    def _placements(self, sharding, num_leaves: int):
        """Per leaf: the single-device sharding it is pulled into, and the sharding it is then
        placed on (None: it stays where it landed)."""
        land = jax.sharding.SingleDeviceSharding(self._device)
        if sharding is None:
            targets = [None] * num_leaves
        elif isinstance(sharding, jax.Device):
            targets = [jax.sharding.SingleDeviceSharding(sharding)] * num_leaves
        elif isinstance(sharding, jax.sharding.Sharding):
            targets = [sharding] * num_leaves
        else:
            targets = jax.tree.leaves(
                sharding, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
            )
            if len(targets) != num_leaves:
                raise ConfigError(
                    f"WeightClient(sharding=...): {len(targets)} shardings for {num_leaves} "
                    "leaves; pass one Sharding or a pytree of them shaped like `like`"
                )
        wire = []
        for i, target in enumerate(targets):
            if target is not None and not target.is_fully_addressable:
                raise ConfigError(
                    f"WeightClient(sharding=...): leaf {self._spec[i][0]}'s sharding spans "
                    "devices of other processes; give this process's devices only"
                )
            # A single-device target is pulled into directly: no second copy.
            if isinstance(target, jax.sharding.SingleDeviceSharding):
                wire.append(target)
                targets[i] = None
            else:
                wire.append(land)
        return wire, targets

    @property
    def version(self) -> int:
        """The newest version `poll()` has returned (the constructor's `version` before)."""
        with self._lock:
            return self._taken

    def poll(self) -> tuple[Any, int] | None:
        """(params, version) for a version newer than the last one returned, else None.

        Background mode: never blocks; the params returned have landed on their devices.
        Otherwise: checks the store and, if there is a newer version, pulls it here.
        Raises what went wrong in the background (ConfigError for a layout mismatch,
        RuntimeError for a lost server)."""
        if self._thread is None:
            got = self._fetch_newer()
            if got is not None:
                with self._lock:
                    self._taken = got[1]
            return got
        with self._lock:
            if self._error is not None:
                raise self._error
            got, self._staged = self._staged, None
            if got is not None:
                self._taken = got[1]
                self._taken_cv.notify_all()
            return got

    def wait(self, timeout_s: float) -> tuple[Any, int] | None:
        """Like poll(), waiting up to `timeout_s` for a newer version (a sampler with nothing
        to decode, or a test)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.poll()
            if got is not None or time.monotonic() >= deadline:
                return got
            time.sleep(0.002)

    def close(self) -> None:
        """Stops the background thread (after the pull in progress, if any)."""
        with self._lock:
            self._stop = True
            self._taken_cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self._wait_s + self._claim_timeout_s)

    # --- the pulling thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    # One pulled copy at a time waits for the sampler (memory bound).
                    while self._staged is not None and not self._stop:
                        self._taken_cv.wait()
                    if self._stop:
                        return
                announcement = self._latest()
                if announcement is not None and announcement["version"] > self._have:
                    got = self._pull(announcement)
                    if got is not None:
                        with self._lock:
                            self._staged = got
                    continue
                n = announcement["n"] + 1 if announcement is not None else 0
                _wait_get(self._client, f"{self.prefix}/wake/{n}", self._wait_s)
        except BaseException as e:
            with self._lock:
                self._error = e

    def _latest(self) -> dict | None:
        text = _try_get(self._client, f"{self.prefix}/latest")
        return None if text is None else json.loads(text)

    def _fetch_newer(self) -> tuple[Any, int] | None:
        announcement = self._latest()
        if announcement is None or announcement["version"] <= self._have:
            return None
        return self._pull(announcement)

    def _send(self, message: dict) -> int:
        k = self._sent
        self._client.key_value_set(
            f"{self.prefix}/to_server/{self._process}/{k}", json.dumps(message)
        )
        self._sent += 1
        return k

    def _check_spec(self, announcement: dict) -> None:
        if announcement["spec"] == self._spec_hash:
            return
        text = _try_get(self._client, f"{self.prefix}/spec/{announcement['spec']}")
        why = "the layouts differ" if text is None else _spec_mismatch(json.loads(text), self._spec)
        raise ConfigError(
            f"weights version {announcement['version']} from process {announcement['server']}: "
            f"{why}; build the sampler's params with the trainer's model config and param_dtype"
        )

    def _connection(self, address: str):
        if address not in self._connections:
            self._connections[address] = self._transfer.connect(address)
        return self._connections[address]

    def _pull(self, announcement: dict) -> tuple[Any, int] | None:
        """Claims, pulls and acks one announced version; None if the server refused the
        claim (a newer version replaced it before anyone started pulling)."""
        version = int(announcement["version"])
        self._check_spec(announcement)
        k = self._send({"op": "claim", "version": version})
        reply_key = f"{self.prefix}/to_client/{self._process}/{k}"
        text = _wait_get(self._client, reply_key, self._claim_timeout_s)
        if text is None:
            raise RuntimeError(
                f"process {self._process}: the weight server (process "
                f"{announcement['server']}) did not answer a claim for version {version} "
                f"within {self._claim_timeout_s:.0f} s; is the trainer process alive?"
            )
        _delete(self._client, reply_key)
        reply = json.loads(text)
        if not reply["ok"]:
            self.stats["refused"] += 1
            return None
        t0 = time.perf_counter()
        try:
            leaves = self._connection(announcement["address"]).pull(reply["uuid"], self._specs)
            # The transfer fills the buffers asynchronously; ack only once they have landed.
            jax.block_until_ready(leaves)
        except Exception as e:
            self._send({"op": "done", "version": version, "ok": False})
            raise RuntimeError(
                f"process {self._process}: pulling weights version {version} from "
                f"{announcement['address']} failed: {str(e).splitlines()[0]}"
            ) from e
        self._send({"op": "done", "version": version, "ok": True})
        dt = time.perf_counter() - t0
        if any(t is not None for t in self._targets):
            leaves = [
                x if t is None else jax.device_put(x, t)
                for x, t in zip(leaves, self._targets, strict=True)
            ]
            jax.block_until_ready(leaves)
        if version > self._have + 1 and self._have >= 0:
            self.stats["skipped"] += version - self._have - 1
        self._have = version
        self.stats["pulls"] += 1
        self.stats["bytes"] += sum(x.nbytes for x in leaves)
        self.stats["pull_s"] += dt
        return self._treedef.unflatten(leaves), version
