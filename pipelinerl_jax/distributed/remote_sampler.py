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

Members: each sampler process serves under a member name, "<sampler index>.<incarnation>",
written under MEMBER when it starts, and its queues carry that name; the trainer attaches the
member when it reads the name. A process restarted with the same launch command is a new
incarnation with fresh queues (an old queue's message counters would collide). Requests
wait in a backlog until some member is attached.

Elastic runs (`lost`): a member whose process stops beating is dropped within seconds. What
it had already returned is kept; its unfinished requests go back to the front of the backlog
in start order (request id) with their original `min_version`, so the lag bound holds
whichever survivor decodes them; attempts that had come back are not taken twice. A member
replaced by a new incarnation of its process is dropped the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pipelinerl_jax.distributed import channel
from pipelinerl_jax.sampler.protocol import Sample
from pipelinerl_jax.sampler.sequence import SamplingParams

REQUESTS = "pipelinerl/sampler/{}/requests"  # trainer -> sampler member
RESULTS = "pipelinerl/sampler/{}/results"  # sampler member -> trainer
VERSION = "pipelinerl/sampler/{}/version"  # the version a member decodes with
MEMBER = "pipelinerl/sampler/{}/member"  # sampler index -> its current member name
STOP = "pipelinerl/stop"
ROSTER_EVERY_S = 0.5  # how often the trainer reads the members' names, versions and beats
ALONE_S = 300.0  # an elastic run with no sampler process for this long fails


def member_name(index: int) -> str:
    """A fresh member name for sampler process `index`: "<index>.<incarnation>"."""
    return f"{index}.{uuid.uuid4().hex[:8]}"


@dataclasses.dataclass
class _Member:
    index: int
    name: str
    sender: channel.Sender
    receiver: channel.Receiver
    requests: dict  # request id -> its message, until every attempt has come back
    version: int


class RemoteSampler:
    """The Sampler protocol over `num_samplers` sampler processes of `slots_each` slots.

    publish(params, version): hands one weight version to every sampler process (the weight
    server's publish); it must not block the caller and must keep `params` alive until pulled.
    prepare(params): the trainer's params -> a private copy on this process's devices (default:
    a copy on their own devices; a trainer spanning several processes gathers instead).
    lost(index) -> bool: whether sampler process `index` has stopped beating (an elastic run;
    None: never asked, a dead sampler ends the run elsewhere); on_lost(name, line): called with
    a dropped member's name (its weight puller goes too) and a line saying what happened.
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
        lost: Callable[[int], bool] | None = None,
        on_lost: Callable[[str, str], None] | None = None,
        on_joined: Callable[[str, str], None] | None = None,
    ):
        self._publish, self._wait_s = publish, wait_s
        self._prepare = prepare
        self._client = client or channel.kv_client()
        self._num_samplers, self._slots_each = num_samplers, slots_each
        self._lost, self._on_lost, self._on_joined = lost, on_lost, on_joined
        self._alone_since = time.monotonic()
        self._members: dict[int, _Member] = {}
        self._backlog: collections.deque = collections.deque()  # messages not sent yet
        self._got: dict[int, set[int]] = {}  # request id -> attempts returned so far
        self._published = version
        self._oldest = version  # the members' oldest version, as last read
        self._next_id = 0
        self._roster_read_at = -float("inf")
        self._stash: list[Sample] = []  # what dropped members returned before they went
        self.dropped: list[str] = []  # member names dropped, in order
        self.attached: list[str] = []  # member names attached, in order

    @property
    def version(self) -> int:
        """The oldest version any live sampler process decodes with (they pull at their own
        pace), as `step()` last read it: the Coordinator reads this every loop, and a store
        round trip per sampler there would cost more than the information is worth
        (admission counts the versions handed over, not this)."""
        return self._oldest

    @property
    def num_slots(self) -> int:
        """The slots of the live sampler processes (of all of them before any attached)."""
        return self._slots_each * (len(self._members) or self._num_samplers)

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
        self._got[int(request_id)] = set()
        self._backlog.append(
            {
                "id": int(request_id),
                "prompt": [int(t) for t in prompt_ids],
                "n": int(n),
                "sampling": dataclasses.asdict(params),
                "min_version": self._published,
            }
        )
        self._dispatch()
        return request_id

    def _outstanding(self, member: _Member) -> int:
        return sum(m["n"] - len(self._got[i]) for i, m in member.requests.items())

    def _dispatch(self) -> None:
        """Sends the backlog, in order, each request to the member with the fewest attempts
        outstanding (so that every process's slots stay busy)."""
        while self._backlog and self._members:
            member = min(self._members.values(), key=self._outstanding)
            message = self._backlog.popleft()
            member.sender.send(message)
            member.requests[message["id"]] = message

    def has_work(self) -> bool:
        return bool(self._backlog) or any(m.requests for m in self._members.values())

    def step(self) -> list[Sample]:
        """The attempts finished since the last call; waits up to `wait_s` for one."""
        self._read_roster()
        out, self._stash = self._stash + self._collect(), []
        if not out and self.has_work():
            time.sleep(self._wait_s)
            out = self._collect()
        return out

    def _collect(self) -> list[Sample]:
        out = []
        for member in list(self._members.values()):
            out += self._receive(member)
        return out

    def _receive(self, member: _Member) -> list[Sample]:
        out = []
        for message in member.receiver.poll():
            rid, attempt = int(message["request_id"]), int(message["attempt"])
            got = self._got.get(rid)
            if got is None or attempt in got:
                continue  # resent after a loss, and this attempt had come back already
            got.add(attempt)
            out.append(Sample(**message))
            request = member.requests.get(rid)
            if request is not None and len(got) == request["n"]:
                del member.requests[rid]
                del self._got[rid]
        return out

    # --- members ---------------------------------------------------------------------------

    def _read_roster(self) -> None:
        """Every ROSTER_EVERY_S: attaches new members, drops lost or replaced ones, and
        reads the live members' versions."""
        now = time.monotonic()
        if now - self._roster_read_at < ROSTER_EVERY_S:
            return
        self._roster_read_at = now
        for index in range(self._num_samplers):
            name = channel.get_value(MEMBER.format(index), None, self._client)
            member = self._members.get(index)
            if member is not None and (name != member.name or self._is_lost(index)):
                why = "restarted" if name != member.name else "stopped beating"
                self._drop(member, why)
                member = None
            if member is None and name is not None and name not in self.dropped:
                self._attach(index, name)
        if self._members:
            self._alone_since = now
        elif self._lost is not None and now - self._alone_since > ALONE_S:
            raise RuntimeError(
                f"no sampler process for {ALONE_S:.0f} s: start one with its launch command "
                "(it joins), or stop the run"
            )
        for m in self._members.values():
            m.version = int(channel.get_value(VERSION.format(m.name), m.version, self._client))
        if self._members:
            self._oldest = min(m.version for m in self._members.values())
        self._dispatch()

    def _is_lost(self, index: int) -> bool:
        return self._lost is not None and self._lost(index)

    def _attach(self, index: int, name: str) -> None:
        self._members[index] = _Member(
            index=index,
            name=name,
            sender=channel.Sender(REQUESTS.format(name), self._client),
            receiver=channel.Receiver(RESULTS.format(name), self._client),
            requests={},
            version=self._published,
        )
        self.attached.append(name)
        if self._on_joined is not None:
            self._on_joined(name, f"sampler {index} ({name}) joined; {len(self._members)} live")

    def _drop(self, member: _Member, why: str) -> None:
        """Drops `member`; its unfinished requests go back to the backlog in start order."""
        self._stash += self._receive(member)  # what it returned before it went is kept
        del self._members[member.index]
        self.dropped.append(member.name)
        resend = sorted(member.requests.values(), key=lambda m: m["id"])
        self._backlog = collections.deque(sorted([*resend, *self._backlog], key=lambda m: m["id"]))
        line = (
            f"sampler {member.index} ({member.name}) {why}: dropped, {len(resend)} "
            f"unfinished request(s) go back to the queue; {len(self._members)} sampler "
            "process(es) left"
        )
        if self._on_lost is not None:
            self._on_lost(member.name, line)

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
    name: str | None = None,
) -> int:
    """Runs sampler process `index` until the trainer calls `RemoteSampler.stop`.

    sampler: this process's PagedSampler. poll_weights() -> (params, version) or None: the
    weight client's poll, called between chunks (params as the trainer published them; the
    sampler prepares them). name: this member's name (default: a fresh member_name(index)).
    Returns how many attempts it finished.
    """
    client = client or channel.kv_client()
    name = name or member_name(index)
    requests = channel.Receiver(REQUESTS.format(name), client)
    results = channel.Sender(RESULTS.format(name), client)
    channel.set_value(MEMBER.format(index), name, client)  # the trainer attaches it now
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
        channel.set_value(VERSION.format(name), sampler.version, client)


def params_from_json(sampling: dict) -> SamplingParams:
    """SamplingParams back from `dataclasses.asdict` sent as JSON (which makes tuples lists)."""
    tuples = {k: tuple(v) for k, v in sampling.items() if isinstance(v, list)}
    return SamplingParams(**dict(sampling, **tuples))
