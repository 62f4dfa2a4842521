"""Samplers in other processes behind the Sampler protocol, and the loop those processes run.

The trainer process keeps the run's Coordinator unchanged and hands it a `RemoteSampler`: the
same seven members (sampler/protocol.py), served by one or more sampler processes, each
running `serve` around its own PagedSampler on its own devices. Requests and finished
attempts travel as JSON over channel.py's queues (one pair per sampler process); weights go
through the trainer's weight server (weight_server.py), which every sampler process polls between
its decode chunks.

Why the lag bound stays exact: admission (pipeline/admission.py) relies on a group started
while the sampler held version v containing only tokens of versions >= v. A request carries
the newest version the trainer had published when it was submitted (`min_version`), and a
sampler process starts it only once the params it decodes the next chunk with are at least
that version; its versions only grow. So every token of the group is >= min_version >= the
version admission counted, whichever process decodes it.

Which process gets a request: the one with the fewest attempts outstanding, so that the slots
of every process stay busy. Where an attempt decodes does not change what it samples
(PagedSampler seeds each attempt from its request id and attempt index).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from pipelinerl_jax.distributed import channel
from pipelinerl_jax.sampler.protocol import Sample
from pipelinerl_jax.sampler.scheduler import SamplingParams

REQUESTS = "pipelinerl/sampler/{}/requests"  # trainer -> sampler process i
RESULTS = "pipelinerl/sampler/{}/results"  # sampler process i -> trainer
VERSION = "pipelinerl/sampler/{}/version"  # the version sampler process i decodes with
STOP = "pipelinerl/stop"


class RemoteSampler:
    """The Sampler protocol over `num_samplers` sampler processes of `slots_each` slots.

    publish(params, version): hands one weight version to every sampler process (the weight
    server's publish); it must not block the caller and must keep `params` alive until pulled.
    prepare(params): the trainer's params -> a private copy on this process's devices (default:
    a copy on their own devices; a trainer spanning several processes gathers instead).
    """

    def __init__(
        self,
        num_samplers: int,
        slots_each: int,
        publish: Callable[[Any, int], None],
        *,
        version: int = 0,
        wait_s: float = 0.02,
        client=None,
        prepare: Callable[[Any], Any] | None = None,
    ):
        self._publish, self._wait_s = publish, wait_s
        self._prepare = prepare
        self._client = client or channel.kv_client()
        self._requests = [
            channel.Sender(REQUESTS.format(i), self._client) for i in range(num_samplers)
        ]
        self._results = [
            channel.Receiver(RESULTS.format(i), self._client) for i in range(num_samplers)
        ]
        self._outstanding = [0] * num_samplers
        self._slots = num_samplers * slots_each
        self._published = version
        self._next_id = 0
        self._versions = [version] * num_samplers  # as last read from the store
        self._versions_read_at = 0.0

    @property
    def version(self) -> int:
        """The oldest version any sampler process decodes with (they pull at their own pace),
        as `step()` last read it: the Coordinator reads this every loop, and a store round
        trip per sampler there would cost more than the information is worth (admission
        counts the versions handed over, not this)."""
        return min(self._versions)

    def _read_versions(self, every_s: float = 0.5) -> None:
        now = time.monotonic()
        if now - self._versions_read_at >= every_s:
            self._versions_read_at = now
            self._versions = [
                channel.get_value(VERSION.format(i), v, self._client)
                for i, v in enumerate(self._versions)
            ]

    @property
    def num_slots(self) -> int:
        return self._slots

    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        n: int = 1,
        params: SamplingParams = SamplingParams(),
        request_id: int | None = None,
    ) -> int:
        if request_id is None:
            request_id = self._next_id
        self._next_id = max(self._next_id, request_id + 1)
        i = min(range(len(self._outstanding)), key=self._outstanding.__getitem__)
        self._requests[i].send(
            {
                "id": int(request_id),
                "prompt": [int(t) for t in prompt_ids],
                "n": int(n),
                "sampling": dataclasses.asdict(params),
                "min_version": self._published,
            }
        )
        self._outstanding[i] += n
        return request_id

    def has_work(self) -> bool:
        return sum(self._outstanding) > 0

    def step(self) -> list[Sample]:
        """The attempts finished since the last call; waits up to `wait_s` for one."""
        out = self._collect()
        if not out and self.has_work():
            time.sleep(self._wait_s)
            out = self._collect()
        self._read_versions()
        return out

    def _collect(self) -> list[Sample]:
        out = []
        for i, receiver in enumerate(self._results):
            for message in receiver.poll():
                self._outstanding[i] -= 1
                out.append(Sample(**message))
        return out

    def prepare(self, params):
        """A copy of the trainer's params on their devices, dispatched and not waited for
        (`device_put(may_alias=False)`; `jnp.copy` ran synchronously on CPU, in the trainer
        thread): the trainer donates its own buffers to the next step,
        the pullers read this copy."""
        if self._prepare is not None:
            return self._prepare(params)
        import jax

        return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), params)

    def set_params(self, params, version: int, *, prepared: bool = False) -> None:
        self._publish(params if prepared else self.prepare(params), int(version))
        self._published = max(self._published, int(version))

    def stop(self) -> None:
        """Tells every sampler process to return from `serve`."""
        channel.set_value(STOP, True, self._client)


def serve(
    sampler,
    index: int,
    poll_weights: Callable[[], tuple[Any, int] | None],
    *,
    idle_s: float = 0.005,
    stop_check_every: int = 20,
    client=None,
) -> int:
    """Runs sampler process `index` until the trainer calls `RemoteSampler.stop`.

    sampler: this process's PagedSampler. poll_weights() -> (params, version) or None: the
    weight client's poll, called between chunks (params as the trainer published them; the
    sampler prepares them). Returns how many attempts it finished.
    """
    client = client or channel.kv_client()
    requests = channel.Receiver(REQUESTS.format(index), client)
    results = channel.Sender(RESULTS.format(index), client)
    waiting: collections.deque = collections.deque()
    next_version = sampler.version  # what the next chunk decodes with
    finished, loops = 0, 0
    while True:
        loops += 1
        if loops % stop_check_every == 0 and channel.get_value(STOP, None, client):
            return finished
        pulled = poll_weights()
        if pulled is not None:
            params, version = pulled
            sampler.set_params(params, version)
            next_version = max(next_version, int(version))
        waiting.extend(requests.poll())
        # In order: a request waits for the version its group was admitted at.
        while waiting and waiting[0]["min_version"] <= next_version:
            r = waiting.popleft()
            sampler.submit(
                r["prompt"], n=r["n"], params=params_from_json(r["sampling"]), request_id=r["id"]
            )
        if not sampler.has_work():
            time.sleep(idle_s)
            continue
        for sample in sampler.step():
            results.send(dataclasses.asdict(sample))
            finished += 1
        channel.set_value(VERSION.format(index), sampler.version, client)


def params_from_json(sampling: dict) -> SamplingParams:
    """SamplingParams back from `dataclasses.asdict` sent as JSON (which makes tuples lists)."""
    tuples = {k: tuple(v) for k, v in sampling.items() if isinstance(v, list)}
    return SamplingParams(**dict(sampling, **tuples))
