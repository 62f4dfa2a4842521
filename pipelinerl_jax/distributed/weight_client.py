"""A sampler process's end of weight publication (the protocol: weights.py)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import jax

from pipelinerl_jax.distributed.channel import kv_client
from pipelinerl_jax.distributed.channel import try_get as _try_get
from pipelinerl_jax.distributed.channel import wait_get as _wait_get
from pipelinerl_jax.distributed.weights import (
    PREFIX,
    TRANSFER_SIZE,
    delete,
    spec_hash,
    spec_mismatch,
    spec_of,
    start_transfer_server,
)
from pipelinerl_jax.errors import ConfigError


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
        puller: str | None = None,
    ):
        self.prefix = prefix
        self._client = client or kv_client()
        self._process = jax.process_index()
        # The name the server knows this puller by: the process id, or (an elastic run, where
        # a restarted process must not reuse its predecessor's queues) a name registered here.
        self._puller = puller or str(self._process)
        if puller is not None:
            self._client.key_value_set(f"{prefix}/pullers/{puller}", "1", allow_overwrite=True)
        self._device = device or jax.local_devices()[0]
        leaves_with_paths, self._treedef = jax.tree_util.tree_flatten_with_path(like)
        self._spec = spec_of(leaves_with_paths)
        self._spec_hash = spec_hash(self._spec)
        self._wire, self._targets = self._placements(sharding, len(leaves_with_paths))
        self._specs = [
            jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype), sharding=wire)
            for (_, shape, dtype), wire in zip(self._spec, self._wire, strict=True)
        ]
        self._transfer = start_transfer_server(self._device, host, transfer_size)
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
            f"{self.prefix}/to_server/{self._puller}/{k}", json.dumps(message)
        )
        self._sent += 1
        return k

    def _check_spec(self, announcement: dict) -> None:
        if announcement["spec"] == self._spec_hash:
            return
        text = _try_get(self._client, f"{self.prefix}/spec/{announcement['spec']}")
        why = "the layouts differ" if text is None else spec_mismatch(json.loads(text), self._spec)
        raise ConfigError(
            f"weights version {announcement['version']} from process {announcement['server']}: "
            f"{why}; build the sampler's params with the trainer's model config and param_dtype"
        )

    def _stopping(self) -> bool:
        with self._lock:
            return self._stop

    def _await_reply(self, key: str) -> str | None:
        """The server's reply at `key`, waited for in slices of `wait_s` so that close() is
        seen; None after `claim_timeout_s`, or once closing."""
        deadline = time.monotonic() + self._claim_timeout_s
        while True:
            left = deadline - time.monotonic()
            text = _wait_get(self._client, key, max(min(self._wait_s, left), 0.001))
            if text is not None or left <= self._wait_s or self._stopping():
                return text

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
        reply_key = f"{self.prefix}/to_client/{self._puller}/{k}"
        text = self._await_reply(reply_key)
        if text is None and self._stopping():
            # close() came while the claim was out; the server, itself closing at the end of
            # a run, may never answer. Waiting out the claim timeout here held close() past
            # jax.distributed's shutdown barrier, which then aborted every process.
            self._send({"op": "done", "version": version, "ok": False})
            return None
        if text is None:
            raise RuntimeError(
                f"process {self._process}: the weight server (process "
                f"{announcement['server']}) did not answer a claim for version {version} "
                f"within {self._claim_timeout_s:.0f} s; is the trainer process alive?"
            )
        delete(self._client, reply_key)
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
