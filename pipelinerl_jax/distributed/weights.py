"""Weight versions from the trainer process to sampler processes, each pulled at its own pace.

This module holds the protocol's shared pieces; the two ends are weight_server.WeightServer
and weight_client.WeightClient.

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
jax.distributed key-value store (plenty for a few hundred bytes per version).
Transfer chunks are 4 MiB rather than jax's default 256 MiB: as fast or faster for every
model measured (a model whose embedding is one default chunk pulled at half the rate), and
each transfer server maps 2 x 8 chunks of host memory up front (pinned on a GPU): 64 MiB
with 4 MiB chunks, 4 GiB with the default (docs/cpu_measurements.md#weight-transfer-chunks).

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
background thread (milliseconds: XLA's CPU client runs part of the copy inline,
docs/cpu_measurements.md#weight-transfer-chunks); the copy is dispatched before `publish` returns because the
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

import hashlib
import json
import socket

import jax

from pipelinerl_jax.distributed.channel import missing as _missing

PREFIX = "pipelinerl/weights"
TRANSFER_SIZE = 4 << 20  # bytes per transfer chunk: 4 MiB (see the module docstring)
WAKE_KEEP = 8  # wake/<n> keys kept; a client further behind re-reads `latest` after wait_s


def delete(client, key: str) -> None:
    try:
        client.key_value_delete(key)
    except Exception as e:
        if not _missing(e):
            raise


def local_host() -> str:
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


def start_transfer_server(device, host: str | None, transfer_size: int):
    from jax.experimental import transfer

    host = host or local_host()
    # A bulk-transport address is required between processes: without one (jaxlib 0.10.2) a
    # pull from another process aborts the serving process (a CHECK failure in socket-server).
    return transfer.start_transfer_server(
        device.client, f"{host}:0", [f"{host}:0"], transfer_size=int(transfer_size)
    )


def spec_of(leaves_with_paths) -> list[list]:
    """[[path, shape, dtype], ...] of a flattened pytree: what both ends must agree on."""
    return [
        [jax.tree_util.keystr(path), [int(d) for d in x.shape], str(x.dtype)]
        for path, x in leaves_with_paths
    ]


def spec_hash(spec: list[list]) -> str:
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def describe(entry) -> str:
    return f"{tuple(entry[1])} {entry[2]}"


def spec_mismatch(theirs: list[list], ours: list[list]) -> str:
    """One line saying where the trainer's leaves and this process's differ."""
    if len(theirs) != len(ours):
        return f"the trainer publishes {len(theirs)} leaves, this process expects {len(ours)}"
    for t, o in zip(theirs, ours, strict=True):
        if t[0] != o[0]:
            return f"leaf {t[0]} on the trainer is {o[0]} here"
        if t[1:] != o[1:]:
            return f"leaf {t[0]} is {describe(t)} on the trainer but {describe(o)} here"
    return "the layouts differ"
