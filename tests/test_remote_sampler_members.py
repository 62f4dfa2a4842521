"""RemoteSampler's members, driven through the key-value protocol by hand (one process): requests
wait until a sampler process attaches; a lost member's unfinished requests go back to the
queue in start order with their admission version, whatever it returned before is kept, and
no attempt comes back twice; a restarted process (a new incarnation) is a new member.
"""

import dataclasses

import pytest

from pipelinerl_jax.distributed import channel, remote_sampler
from pipelinerl_jax.distributed.remote_sampler import MEMBER, REQUESTS, RESULTS, RemoteSampler
from pipelinerl_jax.sampler.protocol import Sample
from tests.test_distributed_weights import _FakeStore


@pytest.fixture(autouse=True)
def roster_every_step(monkeypatch):
    monkeypatch.setattr(remote_sampler, "ROSTER_EVERY_S", 0.0)


class Member:
    """A sampler process's end of the queues, served by hand."""

    def __init__(self, store, index, name):
        self.requests = channel.Receiver(REQUESTS.format(name), store)
        self.results = channel.Sender(RESULTS.format(name), store)
        channel.set_value(MEMBER.format(index), name, store)
        self.got = []

    def read(self):
        self.got += self.requests.poll()
        return self.got

    def answer(self, request, attempts):
        for a in attempts:
            sample = Sample(request["id"], a, request["prompt"], [7], [-0.5], [0], 0, "stop")
            self.results.send(dataclasses.asdict(sample))


def test_a_lost_member_s_requests_are_resent_in_start_order_and_nothing_twice():
    store, dead, said = _FakeStore(), set(), []
    remote = RemoteSampler(
        2,
        4,
        lambda params, version: None,
        client=store,
        wait_s=0.0,
        lost=lambda index: index in dead,
        on_lost=lambda name, line: said.append((name, line)),
    )
    remote.set_params({}, 3, prepared=True)  # requests from here on carry min_version 3
    for rid in range(4):
        remote.submit([1, 2, rid], n=2, request_id=rid)
    assert remote.step() == [] and remote.has_work()  # no sampler process yet: they wait
    a, b = Member(store, 0, "0.a"), Member(store, 1, "1.b")
    remote.step()
    assert sorted(r["id"] for r in a.read() + b.read()) == [0, 1, 2, 3]
    assert remote.num_slots == 8
    first_a = a.read()[0]
    a.answer(first_a, [0])  # one attempt back, then the process dies
    dead.add(0)
    out = remote.step()
    assert [(s.request_id, s.attempt) for s in out] == [(first_a["id"], 0)]
    assert said and said[0][0] == "0.a" and "stopped beating" in said[0][1]
    resent = b.read()[2:]  # after b's own two
    assert [r["id"] for r in resent] == sorted(r["id"] for r in a.read())  # start order
    assert all(r["min_version"] == 3 for r in resent)  # the lag bound's version, unchanged
    assert remote.num_slots == 4
    for r in b.read():
        b.answer(r, [0, 1])  # the resent request's attempt 0 comes back a second time
    got = []
    while remote.has_work():
        got += remote.step()
    pairs = [(s.request_id, s.attempt) for s in out + got]
    assert sorted(pairs) == [(rid, at) for rid in range(4) for at in range(2)]


def test_a_restarted_process_is_a_new_member_and_its_predecessor_is_dropped():
    store, said = _FakeStore(), []
    remote = RemoteSampler(
        1,
        4,
        lambda params, version: None,
        client=store,
        wait_s=0.0,
        on_lost=lambda *a: said.append(a),
    )
    old = Member(store, 0, "0.old")
    remote.submit([5], n=1, request_id=0)
    remote.step()
    assert [r["id"] for r in old.read()] == [0]
    new = Member(store, 0, "0.new")  # the same launch command again: a new incarnation
    remote.step()
    assert remote.attached == ["0.old", "0.new"] and remote.dropped == ["0.old"]
    assert "restarted" in said[0][1]
    (request,) = new.read()
    new.answer(request, [0])
    assert [s.request_id for s in remote.step()] == [0] and not remote.has_work()
