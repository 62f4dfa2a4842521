"""Continuous batching on the host, against a simulated device that keeps a page *content* map.

The fake device writes (token, position) into pages exactly where the real engine writes K/V
(prefill rows, page copies, one write per decode step at position length-1, inactive slots to
the null page) and checks, before every step, that each running sequence's pages hold its own
tokens: sharing, copying, preemption and reuse of freed pages can never corrupt a sequence.
Tokens are a deterministic function of the sequence so far, so every output can be compared
with the sequence generated alone.
"""

import collections

import numpy as np
import pytest

from pipelinerl_jax.sampler.scheduler import Scheduler
from pipelinerl_jax.sampler.sequence import SamplingParams, Sequence

VOCAB, STOP = 50, 7


def next_token(tokens):
    return (sum(tokens) * 31 + len(tokens) * 17) % VOCAB


def solo(prompt, limit, stop_ids=(STOP,)):
    toks = list(prompt)
    while len(toks) < limit:
        toks.append(next_token(toks))
        if toks[-1] in stop_ids:
            break
    return toks[len(prompt) :]


class FakeDevice:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.content = {}  # global page -> {offset: (token, position)}

    def write(self, slot, pos, token):
        page = int(self.sched.mirror["block_tables"][slot][pos // self.sched.page_size])
        self.content.setdefault(page, {})[pos % self.sched.page_size] = (token, pos)

    def prefill(self, rows):
        for row in rows:  # positions before row.start are cached already: left untouched
            for pos in range(row.start, len(row.tokens)):
                self.write(row.slot, pos, row.tokens[pos])

    def copy(self, copies):
        for src, dst in copies:
            self.content[dst] = dict(self.content.get(src, {}))

    def verify(self):
        s = self.sched.page_size
        for seq in self.sched.running:
            table = self.sched.mirror["block_tables"][seq.slot]
            for pos, tok in enumerate(seq.all_tokens[:-1]):
                assert self.content[int(table[pos // s])][pos % s] == (tok, pos), (
                    f"request {seq.request_id}.{seq.attempt}: position {pos} corrupted"
                )

    def decode(self, k):
        m, b = self.sched.mirror, self.sched.num_slots
        out = np.zeros((b, k), np.int32)
        valid = np.zeros((b, k), bool)
        active = m["active"].copy()
        for slot, seq in enumerate(self.sched.slots):
            if seq is None:
                continue
            toks = seq.all_tokens
            for i in range(k):
                if not active[slot]:
                    break
                self.write(slot, len(toks) - 1, toks[-1])
                toks = toks + [next_token(toks)]
                out[slot, i], valid[slot, i] = toks[-1], True
                if toks[-1] in seq.stop_ids or len(toks) >= seq.limit:
                    active[slot] = False
        return out, np.zeros((b, k), np.float32), np.where(valid, 3, -1), valid, active


def make_seqs(rid, prompt, n, max_new, capacity=10**9):
    # As the Sampler does: a sequence never outgrows what the pool can hold alone.
    limit = min(len(prompt) + max_new, capacity + 1)
    return [
        Sequence(
            request_id=rid,
            attempt=a,
            prompt=list(prompt),
            params=SamplingParams(max_new_tokens=max_new),
            seed=a,
            limit=limit,
            stop_ids=(STOP,),
        )
        for a in range(n)
    ]


def drive(sched, k, on_finished, *, version, max_chunks):
    """Chunk boundaries as the sampler runs them, on the fake device, until no work is left;
    every finished sequence goes to `on_finished`. A boundary that admits nothing while work
    waits and nothing runs fails at once (it would repeat forever)."""
    dev = FakeDevice(sched)
    for _ in range(max_chunks):
        if not sched.has_work():
            break
        sched.reserve(k)
        rows, copies = sched.admit(k, version=version)
        dev.prefill(rows)
        dev.copy(copies)
        sched.check()
        dev.verify()
        assert sched.running or not sched.waiting, (
            f"stalled: nothing running, {sched.num_waiting} waiting, "
            f"{[a.num_free for a in sched.allocators]} pages free"
        )
        for seq in sched.record(*dev.decode(k)):
            on_finished(seq)
        sched.check()


def run(sched, groups, k, max_chunks=500):
    for g in groups:
        sched.enqueue(g)
    finished = []
    drive(sched, k, finished.append, version=3, max_chunks=max_chunks)
    assert not sched.has_work(), "scheduler did not finish"
    return finished


@pytest.mark.parametrize("num_pages,shards", [(64, 1), (9, 1), (16, 2)])
def test_all_finish_with_solo_outputs_under_pressure(num_pages, shards):
    rng = np.random.default_rng(num_pages)
    sched = Scheduler(
        num_slots=4,
        num_pages=num_pages,
        page_size=4,
        pages_per_slot=12,
        max_stop_tokens=2,
        num_shards=shards,
    )
    groups = []
    for rid in range(12):
        prompt = rng.integers(0, VOCAB, size=rng.integers(1, 20)).tolist()
        groups.append(
            make_seqs(
                rid,
                prompt,
                n=int(rng.integers(1, 4)),
                max_new=int(rng.integers(1, 25)),
                capacity=sched.capacity_tokens(),
            )
        )
    finished = run(sched, groups, k=3)
    assert len(finished) == sum(len(g) for g in groups)
    for seq in finished:
        want = solo(seq.prompt, seq.limit)
        assert seq.tokens == want, (seq.request_id, seq.attempt)
        assert seq.finish_reason == ("stop" if want[-1] == STOP else "length")
        assert seq.versions == [3] * len(want) and seq.start_version == 3
    if num_pages == 9:
        assert sched.preemptions > 0, "the tiny pool should have forced preemption"
    for alloc in sched.allocators:
        assert alloc.num_free == alloc.usable_pages  # everything returned


def test_group_shares_full_prompt_pages_and_copies_the_partial_one():
    sched = Scheduler(num_slots=4, num_pages=32, page_size=4, pages_per_slot=8, max_stop_tokens=1)
    sched.enqueue(make_seqs(0, list(range(10, 20)), n=3, max_new=5))  # 10 tokens: 9 cached
    sched.reserve(2)
    rows, copies = sched.admit(2, version=0)
    assert len(rows) == 1 and rows[0].tokens == list(range(10, 19))
    seqs = sched.running
    shared = seqs[0].pages[:2]  # 9 cached positions: 2 full pages of 4
    assert all(s.pages[:2] == shared for s in seqs)
    assert all(sched.allocators[0].refcount(p) == 3 for p in shared)
    partial = [s.pages[2] for s in seqs]
    assert len(set(partial)) == 3  # private copies of the partial page
    assert copies == [(partial[0], partial[1]), (partial[0], partial[2])]
    sched.check()


def test_preempted_sequence_resumes_with_its_tokens():
    sched = Scheduler(num_slots=2, num_pages=6, page_size=4, pages_per_slot=8, max_stop_tokens=1)
    a, b = make_seqs(0, [1, 2, 3], 1, 12)[0], make_seqs(1, [4, 5, 6], 1, 12)[0]
    a.stop_ids = b.stop_ids = ()
    finished = run(sched, [[a], [b]], k=4)
    assert sched.preemptions >= 1
    assert max(s.preemptions for s in finished) >= 1
    for seq in finished:
        assert seq.tokens == solo(seq.prompt, seq.limit, stop_ids=())
        assert len(seq.tokens) == 12 and seq.finish_reason == "length"


def _episode_run(sched, rng, episodes, turns, k, max_chunks=3000):
    """Episodes of several turns on a tight pool: whatever finishes in a chunk is resumed at
    once with a fresh observation (several resumed episodes queue together, each holding its
    cache) or released after its last turn. `drive` fails the moment a boundary admits nothing
    while nothing runs and work waits: the livelock seen with the README's environment.
    Returns (attempts submitted, episodes ended)."""
    cap = sched.capacity_tokens() + 1
    for rid in range(episodes):
        prompt = rng.integers(0, VOCAB, size=rng.integers(2, 12)).tolist()
        for seq in make_seqs(rid, prompt, n=int(rng.integers(1, 3)), max_new=6, capacity=cap - 1):
            seq.keep, seq.stop_ids = True, ()
            sched.enqueue([seq])
    attempts = sched.num_waiting
    turns_done = collections.Counter()

    def next_turn(seq):
        key = (seq.request_id, seq.attempt)
        turns_done[key] += 1
        obs = rng.integers(0, VOCAB, size=rng.integers(1, 6)).tolist()
        if turns_done[key] >= turns or seq.length + len(obs) + 1 > cap:
            sched.drop(key)
            turns_done["ended"] += 1
        else:
            sched.resume(key, obs, min(seq.length + len(obs) + 4, cap))

    drive(sched, k, next_turn, version=0, max_chunks=max_chunks)
    assert not sched.has_work() and not sched.parked, "episodes did not finish"
    return attempts, turns_done["ended"]


@pytest.mark.parametrize("seed", range(6))
def test_resumed_episodes_queued_together_never_stall_a_tight_pool(seed):
    rng = np.random.default_rng(seed)
    sched = Scheduler(num_slots=4, num_pages=14, page_size=4, pages_per_slot=12, max_stop_tokens=1)
    attempts, done = _episode_run(sched, rng, episodes=6, turns=4, k=3)
    assert done == attempts
    assert sched.evictions > 0, "the pool should have been tight enough to evict caches"
    for alloc in sched.allocators:
        assert alloc.num_free == alloc.usable_pages  # everything returned
