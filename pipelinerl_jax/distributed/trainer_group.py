"""One trainer over several processes: the leader runs the pipeline, followers replay its calls.

JAX is multi-controller: a jitted computation over a mesh that spans several processes runs
only when every one of them calls it, with equal arguments, in the same order. With
`devices.trainer_processes` = T > 1 the trainer mesh spans processes 0..T-1 (FSDP x TP over all
their trainer devices). Process 0, the leader, runs the pipeline exactly as a one-trainer run
does: data, admission, rewards, metrics and weights for the samplers stay there, so data order
and the lag bound are those of a one-process run and nothing host-side has to agree across
processes. Its trainer calls that touch the global mesh go through `Leader`, which first sends
each one to the followers (processes 1..T-1) over the jax.distributed key-value store:

    step      a train step, with its host batch (a .npz payload)
    gather    the params replicated, so the leader holds a whole copy (for the weight server
              and held-out evaluation); the followers drop theirs
    gather_full  the same of the whole model: with LoRA, the adapters joined to the frozen
              base (held-out evaluation needs the model; the weight server the adapters only)
    open      the run's checkpointer (Orbax's manager meets the others at a barrier)
    save      an Orbax checkpoint of the sharded state (every process writes its shards)
    read      a checkpoint's JSON item (Orbax's restore is collective even for JSON)
    restore   the newest readable checkpoint, onto the same shardings
    close     the checkpointer's last write and its barriers
    stop      the end of the run

A follower (`follow`) holds its own Trainer and its shards of the TrainState and makes the same
calls in the same order. Message n is "<prefix>/<n>" (and "<prefix>/<n>.npz"), read by every
follower and never rewritten; each follower acknowledges with "<prefix>/ack/<i>" and the leader
deletes what all of them have read, so the store holds only the last few messages.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pipelinerl_jax import glibc_malloc
from pipelinerl_jax.distributed import channel
from pipelinerl_jax.rl.batch import TrainBatch
from pipelinerl_jax.train.checkpoint import CorruptCheckpointError, RunCheckpointer

log = logging.getLogger(__name__)

PREFIX = "pipelinerl/trainer"
# A follower waits this long for the leader's next call before looking again; the leader may
# legitimately be quiet for long (waiting for rollouts, evaluating), so this is no timeout: a
# dead leader ends the follower through the failure watcher or JAX's heartbeat instead.
POLL_S = 5.0


def pack_batch(batch: TrainBatch) -> bytes:
    """A host TrainBatch as .npz bytes (every field, exact)."""
    buf = io.BytesIO()
    np.savez(buf, **{name: np.asarray(getattr(batch, name)) for name in _fields()})
    return buf.getvalue()


def unpack_batch(payload: bytes) -> TrainBatch:
    with np.load(io.BytesIO(payload)) as npz:
        return TrainBatch(**{name: npz[name] for name in _fields()})


def _fields() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainBatch)]


def group_devices(trainer_processes: int) -> list:
    """The trainer mesh's devices: every device of processes 0..trainer_processes-1, process
    by process (the samplers are other processes, so trainers keep all of theirs)."""
    return [d for d in jax.devices() if d.process_index < trainer_processes]


def gather_fn(mesh):
    """params (sharded over `mesh`) -> a replicated private copy (never the same buffers: the
    next step donates the trainer's)."""
    return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=NamedSharding(mesh, P()))


class Leader:
    """The trainer as the leader's Coordinator sees it: a Trainer whose global-mesh calls are
    replayed by the followers. Every other attribute is the Trainer's."""

    def __init__(self, trainer, followers: Sequence[int], *, prefix: str = PREFIX, client=None):
        self.trainer = trainer
        self.followers = tuple(int(f) for f in followers)
        self.prefix = prefix
        self._client = client or channel.kv_client()
        self._sent = 0
        self._deleted = 0
        self._gather = gather_fn(trainer.mesh)

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    def send(self, op: str, payload: bytes | None = None, **fields) -> None:
        """Message `op` to every follower (before the leader makes the call itself)."""
        n = self._sent
        if payload is not None:
            self._client.key_value_set_bytes(f"{self.prefix}/{n}.npz", payload)
        self._client.key_value_set(f"{self.prefix}/{n}", json.dumps({"op": op, **fields}))
        self._sent += 1
        self._forget_read()

    def _forget_read(self) -> None:
        acked = min(
            channel.get_value(f"{self.prefix}/ack/{f}", -1, self._client) for f in self.followers
        )
        while self._deleted <= acked:
            for key in (f"{self.prefix}/{self._deleted}", f"{self.prefix}/{self._deleted}.npz"):
                try:
                    self._client.key_value_delete(key)
                except Exception as e:  # noqa: BLE001 - already gone is fine
                    if not channel.missing(e):
                        raise
            self._deleted += 1

    # --- the calls the pipeline makes --------------------------------------------------------

    def train_step(self, state, batch: TrainBatch):
        self.send("step", pack_batch(batch))
        return self.trainer.train_step(state, batch)

    def local_params(self, params):
        """A whole copy of `params` on one of the leader's devices, as single-device arrays."""
        self.send("gather")
        return jax.tree.map(lambda x: x.addressable_data(0), self._gather(params))

    def local_full_params(self, params):
        """`local_params` of the whole model: with LoRA the adapters joined to the base."""
        self.send("gather_full")
        full = self._gather(self.trainer.full_params(params))
        return jax.tree.map(lambda x: x.addressable_data(0), full)

    def checkpointer(self, *args, **kwargs) -> LeaderCheckpointer:
        """A RunCheckpointer(*args, **kwargs) over the trainer processes, its saves, restores
        and close replayed by the followers."""

        processes = (jax.process_index(), *self.followers)
        self.send("open")
        return LeaderCheckpointer(self, RunCheckpointer(*args, processes=processes, **kwargs))

    def stop(self) -> None:
        self.send("stop")


class LeaderCheckpointer:
    """A RunCheckpointer whose collective calls are sent to the followers first."""

    def __init__(self, leader: Leader, inner):
        self._leader, self._inner = leader, inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def save(self, step: int, train_state, extra: dict) -> bool:
        self._leader.send("save", step=int(step), extra=extra)
        return self._inner.save(step, train_state, extra)

    def read_json(self, step: int, item: str) -> dict:
        self._leader.send("read", step=int(step), item=item)
        return self._inner.read_json(step, item)

    def restore_latest(self, abstract_train_state):
        self._leader.send("restore")
        return self._inner.restore_latest(abstract_train_state)

    def close(self) -> None:
        self._leader.send("close")
        self._inner.close()


def abstract_of(state, shardings):
    """The restore target for `state`: shapes, dtypes and the trainer's shardings."""
    return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, shardings
    )


def follow(
    trainer,
    state,
    open_checkpointer,
    index: int,
    *,
    prefix: str = PREFIX,
    client=None,
    trim: bool = False,
) -> dict[str, int]:
    """A follower's whole life: the leader's calls in order until "stop"; returns how many of
    each it made. `index` is this follower's process id; `open_checkpointer()` makes the
    RunCheckpointer over the trainer processes that the leader's "open" asks for; `trim`:
    free heap pages go back to the kernel before each step (RunConfig.trim_host_memory)."""
    client = client or channel.kv_client()
    checkpointer = None
    gather = gather_fn(trainer.mesh)
    counts: dict[str, int] = {}
    n = 0
    while True:
        text = channel.wait_get(client, f"{prefix}/{n}", POLL_S)
        if text is None:
            continue
        message = json.loads(text)
        op = message["op"]
        if op == "step":
            payload = client.blocking_key_value_get_bytes(f"{prefix}/{n}.npz", 60_000)
            batch = unpack_batch(payload)
        channel.set_value(f"{prefix}/ack/{index}", n, client)
        n += 1
        counts[op] = counts.get(op, 0) + 1
        if op == "step":
            if trim:
                glibc_malloc.release()
            state, _ = trainer.train_step(state, batch)
        elif op == "gather":
            gather(state.params)  # our part of the collective; the copy is dropped
        elif op == "gather_full":
            gather(trainer.full_params(state.params))
        elif op == "open":
            checkpointer = open_checkpointer()
        elif op == "save":
            checkpointer.save(message["step"], state, message["extra"])
        elif op == "read":
            try:
                checkpointer.read_json(message["step"], message["item"])
            except CorruptCheckpointError:
                pass  # the leader meets the same damage and decides what to do
        elif op == "restore":
            restored = checkpointer.restore_latest(abstract_of(state, trainer.state_shardings))
            if restored is not None:
                state = restored[1]
        elif op == "close":
            checkpointer.close()
            checkpointer = None
        elif op == "stop":
            if checkpointer is not None:
                checkpointer.close()
            jax.block_until_ready(state)
            return counts
        else:
            raise RuntimeError(f"trainer follower: unknown call {op!r} from the leader")
