"""Weight versions cross processes bit for bit, in order, each pulled at its puller's pace.

Three localhost processes under jax.distributed (1 trainer with a WeightServer, 2 samplers
with WeightClients; this file is also their entry point) exchange several versions of a
random params pytree (f32 and bf16 leaves of different shapes, fresh values per version). One
sampler polls from a background thread every few ms and lands some leaves on a 2-device
sharding; the other pulls synchronously and decodes slowly, so it skips versions. The server
publishes version 3 while the slow sampler's first pull is held in flight. The samplers report
what they pulled as hashes; the test checks every pulled version against what the server published under that
number, that versions only grow, that publish returned fast, that the server held at most the
newest version plus one per in-flight pull and freed everything once the last was acked, and
that a sampler expecting another layout gets a one-line ConfigError naming the leaf.

A second test drives the server's bookkeeping by hand in this process (an in-memory store in
place of jax.distributed's): unclaimed superseded versions are dropped at once, claimed ones
live until their pull is reported done.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.xla_env import xla_flags

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = 10  # published: 1 .. VERSIONS
PULLERS = (1, 2)
PUBLISH_BOUND_S = 0.25  # publish only dispatches a copy and queues a message
CHILD_TIMEOUT_S = 120


def _params(version: int) -> dict:
    """A small params pytree with fresh random values per version (~11 MB: a pull takes
    long enough on this machine for a publish to land during it)."""
    import ml_dtypes

    rng = np.random.default_rng(version)

    def f32(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    def bf16(*shape):
        return f32(*shape).astype(ml_dtypes.bfloat16)

    return {
        "embed": f32(512, 256),
        "layers": [
            {"w": bf16(256, 1024), "b": f32(1024)},
            {"w": bf16(1024, 256), "scale": f32(3)},
        ],
        "head": f32(2048, 1024),
    }


def _digest(tree) -> str:
    """sha256 over every leaf's bytes, dtype and shape, in pytree order."""
    import jax

    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        a = np.asarray(x)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


# --- the processes ------------------------------------------------------------------------


def _server(out: Path) -> None:
    from pipelinerl_jax.distributed.channel import kv_client
    from pipelinerl_jax.distributed.weight_server import WeightServer

    server = WeightServer(PULLERS, prefix="test/weights")
    published, publish_s, live = {}, [], []
    for version in range(1, VERSIONS + 1):
        params = _params(version)
        published[version] = _digest(params)
        if version == 3:
            # Publish while a sampler is mid-pull: the pulled version must stay intact. The
            # slow sampler holds its first pull open until this publish is done (_held), so
            # the wait ends however loaded the machine is.
            deadline = time.monotonic() + 60
            while server.pulls_in_flight() == 0 and time.monotonic() < deadline:
                time.sleep(0.0005)
        t0 = time.perf_counter()
        server.publish(params, version)
        publish_s.append(time.perf_counter() - t0)
        live.append(server.live_versions)
        if version == 3:
            kv_client().key_value_set("test/released", "1")
        time.sleep(0.03)
    idle = server.wait_idle(60)
    client = kv_client()
    for p in PULLERS:  # the samplers write their results before saying done
        client.blocking_key_value_get(f"test/done/{p}", 60_000)
    report = {
        "published": published,
        "publish_s": publish_s,
        "live_after_publish": live,
        "idle": idle,
        "live_at_end": server.live_versions,
        "stats": server.stats,
    }
    server.close()
    out.write_text(json.dumps(report))


def _sampler(process: int, out: Path) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pipelinerl_jax.distributed.channel import kv_client
    from pipelinerl_jax.distributed.weight_client import WeightClient
    from pipelinerl_jax.errors import ConfigError

    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _params(0))
    report: dict = {"pulled": []}
    if process == 1:
        # Background pulls, a fast "decode loop", `head` sharded over 2 local devices.
        mesh = Mesh(np.array(jax.local_devices()), ("d",))
        sharding = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), like)
        sharding["head"] = NamedSharding(mesh, PartitionSpec("d", None))
        wc = WeightClient(like, sharding=sharding, prefix="test/weights")
        chunk_s = 0.005
    else:
        wc = WeightClient(like, background=False, prefix="test/weights")
        chunk_s = 0.12  # slow: some versions are replaced before it gets to them
        _held(wc)
        bad = jax.tree.map(lambda x: x, like)
        bad["layers"][1]["w"] = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
        # The layout is checked before any claim, so this client never talks to the server.
        wrong = WeightClient(bad, background=False, prefix="test/weights")
        report["layout_error"] = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if wrong.poll() is not None:
                    break
            except ConfigError as e:
                report["layout_error"] = str(e)
                break
            time.sleep(0.01)
    deadline = time.monotonic() + 90
    while wc.version < VERSIONS and time.monotonic() < deadline:
        got = wc.poll()
        if got is not None:
            params, version = got
            report["pulled"].append(
                {
                    "version": version,
                    "digest": _digest(params),
                    # Process 1 asked for `head` split over its 2 devices, the rest replicated.
                    "placed": process != 1
                    or all(
                        x.sharding == s
                        for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(sharding))
                    ),
                }
            )
        time.sleep(chunk_s)  # one decode chunk
    report["stats"] = wc.stats
    wc.close()
    out.write_text(json.dumps(report))
    kv_client().key_value_set(f"test/done/{process}", "1")


def _held(wc) -> None:
    """Holds `wc`'s first pull open, after its claim, until the server has published
    version 3: a publish lands during a pull on any machine, not only on an idle one."""
    from pipelinerl_jax.distributed.channel import kv_client

    connect, first = wc._connection, [True]

    class Held:
        def __init__(self, connection):
            self.connection = connection

        def pull(self, *args):
            if first:
                first.clear()
                kv_client().blocking_key_value_get("test/released", 60_000)
            return self.connection.pull(*args)

    wc._connection = lambda address: Held(connect(address))


def _main(argv) -> None:
    from pipelinerl_jax.distributed import runtime

    coordinator, process, out = argv[0], int(argv[1]), Path(argv[2])
    spec = runtime.ProcessSpec(coordinator, num_processes=3, process_id=process)
    runtime.initialize(spec, heartbeat_s=5, init_timeout_s=30, shutdown_timeout_s=10)
    import jax

    if process == 0:
        _server(out)
    else:
        _sampler(process, out)
    jax.distributed.shutdown()


# --- the test ----------------------------------------------------------------------------


def test_versions_cross_processes_bit_for_bit(tmp_path):
    from pipelinerl_jax.distributed import runtime

    coordinator = f"127.0.0.1:{runtime.free_port()}"
    children = []
    t0 = time.monotonic()
    try:
        for process in range(3):
            env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
            if process == 1:
                env["XLA_FLAGS"] = xla_flags(devices=2)
            log = open(tmp_path / f"log{process}.txt", "w")
            child = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    coordinator,
                    str(process),
                    str(tmp_path / f"{process}.json"),
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed as one on failure
            )
            children.append((child, log))
        for child, _ in children:
            left = CHILD_TIMEOUT_S - (time.monotonic() - t0)
            child.wait(timeout=max(1.0, left))
    except BaseException:
        for child, _ in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        raise
    finally:
        for _, log in children:
            log.close()
    logs = "\n".join((tmp_path / f"log{i}.txt").read_text()[-3000:] for i in range(3))
    assert [c.returncode for c, _ in children] == [0, 0, 0], logs

    server = json.loads((tmp_path / "0.json").read_text())
    published = {int(v): d for v, d in server["published"].items()}
    assert len(set(published.values())) == VERSIONS  # fresh values every version
    for process in PULLERS:
        report = json.loads((tmp_path / f"{process}.json").read_text())
        versions = [p["version"] for p in report["pulled"]]
        assert versions and versions[-1] == VERSIONS, (process, versions)
        assert versions == sorted(set(versions)), (process, versions)  # strictly increasing
        for p in report["pulled"]:
            assert p["digest"] == published[p["version"]], (process, p["version"])
        if process == 1:
            assert all(p["placed"] for p in report["pulled"])
        else:
            assert len(versions) < VERSIONS, "the slow sampler should have skipped versions"
            error = report["layout_error"]
            assert error is not None and "\n" not in error
            assert "['layers'][1]['w']" in error and "bfloat16" in error and "float32" in error

    stats = server["stats"]
    assert max(server["publish_s"]) < PUBLISH_BOUND_S, server["publish_s"]
    assert stats["published_during_pull"] >= 1, stats
    # At most the newest version plus one per in-flight pull, and nothing once all acked it.
    assert max(server["live_after_publish"]) <= 1 + len(PULLERS), server["live_after_publish"]
    assert server["idle"] and server["live_at_end"] == 0, server
    assert stats["freed"] == VERSIONS, stats
    assert stats["claims"] == stats["acked"] and stats["failed_pulls"] == 0, stats


def test_spec_mismatch_names_the_leaf():
    from pipelinerl_jax.distributed.weights import spec_mismatch as _spec_mismatch

    theirs = [["['a']", [2, 3], "float32"], ["['b']", [4], "bfloat16"]]
    assert "['b'] is (4,) bfloat16 on the trainer but (4,) float32 here" in _spec_mismatch(
        theirs, [theirs[0], ["['b']", [4], "float32"]]
    )
    assert "publishes 2 leaves" in _spec_mismatch(theirs, theirs[:1])


class _FakeStore:
    """The few key-value calls the weight server makes, in memory (no jax.distributed)."""

    def __init__(self):
        import threading

        self.data: dict[str, str] = {}
        self.cv = threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cv:
            assert allow_overwrite or key not in self.data, key
            self.data[key] = value
            self.cv.notify_all()

    def key_value_try_get(self, key):
        with self.cv:
            if key not in self.data:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.data[key]

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.data, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.data[key]

    def key_value_delete(self, key):
        with self.cv:
            self.data.pop(key, None)

    def key_value_dir_get(self, prefix):
        with self.cv:
            return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]

    def wait_for(self, key, timeout_s=10.0):
        return json.loads(self.blocking_key_value_get(key, timeout_s * 1000))


def test_server_drops_unclaimed_versions_and_keeps_claimed_ones():
    """The server's bookkeeping, driven through its key-value protocol by hand (one process):
    a superseded version nobody claimed is dropped at once and a late claim for it refused; a
    claimed one survives newer publishes until its pull is reported done; a version every
    puller acked is freed even while it is the newest."""
    from pipelinerl_jax.distributed.weight_server import WeightServer

    store = _FakeStore()
    server = WeightServer((1, 2), host="127.0.0.1", prefix="w", client=store, wait_s=0.05)
    try:

        def send(puller, k, **message):
            store.key_value_set(f"w/to_server/{puller}/{k}", json.dumps(message))

        server.publish(_params(1), 1)
        assert server.live_versions == 1
        server.publish(_params(2), 2)  # nobody claimed 1: dropped
        assert server.live_versions == 1 and server.stats["dropped_unpulled"] == 1
        send(1, 0, op="claim", version=1)
        assert store.wait_for("w/to_client/1/0") == {"ok": False}
        send(1, 1, op="claim", version=2)
        assert store.wait_for("w/to_client/1/1")["ok"] is True
        # Announcements are written by a background thread: 1's may land before 2's.
        deadline = time.monotonic() + 10
        while store.wait_for("w/latest")["version"] != 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert store.wait_for("w/latest")["version"] == 2
        server.publish(_params(3), 3)  # 2 is mid-pull by puller 1: kept
        assert server.live_versions == 2 and server.pulls_in_flight() == 1
        send(1, 2, op="done", version=2, ok=True)
        deadline = time.monotonic() + 10
        while server.live_versions != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert server.live_versions == 1  # 2 freed: superseded and no pull left
        for puller, k in ((1, 3), (2, 0)):
            send(puller, k, op="claim", version=3)
            assert store.wait_for(f"w/to_client/{puller}/{k}")["ok"] is True
            send(puller, k + 1, op="done", version=3, ok=True)
        assert server.wait_idle(10)  # every puller acked 3
        assert server.stats["freed"] == 3 and server.stats["refused"] == 1
        assert not [k for k in store.data if "/to_server/" in k]  # the server consumed them
        with pytest.raises(RuntimeError, match="versions must increase"):
            server.publish(_params(3), 3)
    finally:
        server.close()


def test_elastic_pullers_register_leave_and_find_the_latest_version():
    """An elastic server starts with no puller: one registers itself (WeightClient(puller=)),
    and the newest version stays offered after every puller acked it, so a later joiner can
    pull it; a removed puller's claim in flight no longer keeps a superseded version."""
    from pipelinerl_jax.distributed.weight_server import WeightServer

    store = _FakeStore()
    server = WeightServer(
        (), host="127.0.0.1", prefix="w", client=store, wait_s=0.05, keep_latest=True
    )
    try:

        def send(puller, k, **message):
            store.key_value_set(f"w/to_server/{puller}/{k}", json.dumps(message))

        def until(predicate):
            deadline = time.monotonic() + 10
            while not predicate() and time.monotonic() < deadline:
                time.sleep(0.005)
            assert predicate()

        server.publish(_params(1), 1)
        store.key_value_set("w/pullers/1.aa", "1")  # a sampler process registers
        until(lambda: server.pullers == {"1.aa"})
        send("1.aa", 0, op="claim", version=1)
        assert store.wait_for("w/to_client/1.aa/0")["ok"] is True
        send("1.aa", 1, op="done", version=1, ok=True)
        until(lambda: server.stats["acked"] == 1)
        assert server.live_versions == 1  # every puller has it, yet it is still offered
        store.key_value_set("w/pullers/2.bb", "1")  # a sampler joins late
        until(lambda: server.pullers == {"1.aa", "2.bb"})
        send("2.bb", 0, op="claim", version=1)
        assert store.wait_for("w/to_client/2.bb/0")["ok"] is True  # it can pull version 1
        server.publish(_params(2), 2)  # 1 is mid-pull by 2.bb: kept ...
        assert server.live_versions == 2
        server.remove_puller("2.bb")  # ... until 2.bb is gone (its process died)
        assert server.live_versions == 1 and server.pullers == {"1.aa"}
    finally:
        server.close()


def test_close_does_not_wait_out_an_unanswered_claim():
    """A sampler closing while its claim is out (the trainer's server closing at the end of a
    run) stops within a few `wait_s`, not the claim timeout, and withdraws the claim. Waiting
    it out held the sampler past jax.distributed's shutdown barrier, which aborted the run."""
    import jax

    from pipelinerl_jax.distributed.weight_client import WeightClient
    from pipelinerl_jax.distributed.weights import spec_hash, spec_of

    store = _FakeStore()
    like = _params(1)
    leaves, _ = jax.tree_util.tree_flatten_with_path(like)
    client = WeightClient(
        like, host="127.0.0.1", prefix="w", client=store, claim_timeout_s=60.0, wait_s=0.05
    )
    announcement = {"version": 1, "spec": spec_hash(spec_of(leaves)), "n": 0, "server": 0}
    store.key_value_set("w/latest", json.dumps({**announcement, "address": "127.0.0.1:1"}))
    store.key_value_set("w/wake/0", "1")
    assert store.wait_for("w/to_server/0/0") == {"op": "claim", "version": 1}
    t0 = time.monotonic()
    client.close()
    assert time.monotonic() - t0 < 5
    assert store.wait_for("w/to_server/0/1") == {"op": "done", "version": 1, "ok": False}
    assert client.poll() is None


if __name__ == "__main__":
    _main(sys.argv[1:])
