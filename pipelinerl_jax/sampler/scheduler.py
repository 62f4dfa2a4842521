"""Continuous batching on the host, between decode chunks (no JAX in here).

At every chunk boundary the driver asks the scheduler to
  1. `reserve(k)`: give every running sequence the pages its next k steps write, preempting
     the most recently admitted sequence of the same shard when the pool runs out (its pages
     are freed, it goes back to the front of the queue keeping its tokens, and is resumed
     later by re-prefilling prompt + generated tokens);
  1b. `compact()` (with sampler.decode_widths > 1): move running sequences into the lowest
     free slots of their shard, so the decode chunk can run on a narrower batch;
  2. `admit(k)`: move waiting groups into free slots while pages last; the n attempts of a
     prompt admitted together share its prefill: one prefill row writes the prompt's K/V, its
     full pages are shared by refcount and each other attempt gets a copy of the partially
     filled last page;
  3. (the driver runs prefill, page copies and the decode chunk)
  4. `record(...)`: append the chunk's tokens, retire finished sequences, free their pages.

Episodes (a sequence submitted with `keep`): a finished turn is parked instead of retired: it
leaves its slot but keeps its pages, so `resume` (the environment's observation tokens
appended) re-admits it with only the new tokens to prefill, onto the same pages, in the shard
that holds them. Cached pages are the first to go when the pool runs out (`_make_room`):
parked episodes', then those of resumed episodes still queued; an evicted sequence is
resumed by re-prefilling all its tokens, as a preempted one is.
Observation tokens carry version -1 and logprob 0: no policy produced them.

Stop strings (`SamplingParams.stop_strings`, text the environment names, e.g. "</calc>"): after
each chunk `record` decodes the current turn's tokens once (`detokenize`); when the text holds
a stop string, the turn ends at the first token that completes one and the tokens decoded
after it are dropped (sampler/stop_strings.py). Their K/V sit past the kept length, where nothing
reads them: a resumed episode's prefill and decode overwrite those positions, and `_park`
frees the pages past what its cache needs.

Page ids are global indices into the pool [L, P, ...]; with D data shards the pool's pages
are split in D equal ranges and a slot of shard d only gets pages of range d (its local page 0
is that shard's null page). Slot mirrors (numpy) are what the driver uploads.

The records it moves (SamplingParams, Sequence, PrefillRow) are in sampler/sequence.py.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np

from pipelinerl_jax.sampler.pages import OutOfPages, PageAllocator, pages_for
from pipelinerl_jax.sampler.sequence import PrefillRow, Sequence
from pipelinerl_jax.sampler.state import SLOT_FIELDS
from pipelinerl_jax.sampler.stop_strings import stop_string_cut


class Scheduler:
    """Slot table, waiting queue and page allocators (one per data shard)."""

    def __init__(
        self,
        *,
        num_slots: int,
        num_pages: int,
        page_size: int,
        pages_per_slot: int,
        max_stop_tokens: int,
        num_shards: int = 1,
        detokenize=None,
    ):
        if num_slots % num_shards or num_pages % num_shards:
            raise ValueError(
                f"num_slots={num_slots} and num_pages={num_pages} must divide by "
                f"the {num_shards} data shards"
            )
        self.num_slots, self.page_size, self.num_shards = num_slots, page_size, num_shards
        self.pages_per_shard = num_pages // num_shards
        self.slots_per_shard = num_slots // num_shards
        self.allocators = [PageAllocator(self.pages_per_shard) for _ in range(num_shards)]
        self.pages_per_slot = pages_per_slot
        self.max_stop_tokens = max_stop_tokens
        self.detokenize = detokenize  # list[int] -> str, for stop strings (None: no text)
        self.slots: list[Sequence | None] = [None] * num_slots
        self.waiting: collections.deque[list[Sequence]] = collections.deque()
        self.parked: dict[tuple[int, int], Sequence] = {}  # (request, attempt) -> sequence
        self._admissions = itertools.count()
        self.preemptions = 0
        self.evictions = 0  # episode caches (parked or queued) whose pages were taken back
        self.mirror = {name: None for name in SLOT_FIELDS}
        self.mirror.update(
            block_tables=np.zeros((num_slots, pages_per_slot), np.int32),
            last_token=np.zeros(num_slots, np.int32),
            lengths=np.ones(num_slots, np.int32),
            limit=np.ones(num_slots, np.int32),
            active=np.zeros(num_slots, np.bool_),
            temperature=np.zeros(num_slots, np.float32),
            top_k=np.zeros(num_slots, np.int32),
            top_p=np.ones(num_slots, np.float32),
            stop_tokens=np.full((num_slots, max_stop_tokens), -1, np.int32),
            seeds=np.zeros(num_slots, np.uint32),
        )
        for slot in range(num_slots):
            self.mirror["block_tables"][slot] = self._null(slot)
        self.dirty = True  # mirrors differ from the device state

    # --- bookkeeping ----------------------------------------------------------------------

    def shard_of(self, slot: int) -> int:
        return slot // self.slots_per_shard

    def _null(self, slot: int) -> int:
        return self.shard_of(slot) * self.pages_per_shard

    def _alloc(self, shard: int, n: int) -> list[int]:
        base = shard * self.pages_per_shard
        return [base + p for p in self.allocators[shard].alloc(n)]

    def _free(self, seq: Sequence) -> None:
        if seq.pages:
            shard = self.shard_of(seq.slot) if seq.slot is not None else seq.shard
            base = shard * self.pages_per_shard
            self.allocators[shard].free([p - base for p in seq.pages])
        seq.pages = []
        seq.cached = 0

    def capacity_tokens(self) -> int:
        """KV positions one sequence can ever hold (a whole shard's pages, or the table)."""
        return min(self.allocators[0].usable_pages, self.pages_per_slot) * self.page_size

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    @property
    def num_waiting(self) -> int:
        return sum(len(g) for g in self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def enqueue(self, group: list[Sequence]) -> None:
        self.waiting.append(group)

    def kv_after_chunk(self, seq: Sequence, k: int) -> int:
        """K/V positions this sequence holds after k more steps (never past limit - 1)."""
        return min(seq.length - 1 + k, seq.limit - 1)

    def _set_table(self, seq: Sequence) -> None:
        row = self.mirror["block_tables"][seq.slot]
        row[:] = self._null(seq.slot)
        row[: len(seq.pages)] = seq.pages
        self.dirty = True

    # --- 1. reserve pages for the next chunk ----------------------------------------------

    def reserve(self, k: int) -> list[Sequence]:
        """Gives running sequences pages for k steps; returns the sequences it preempted."""
        preempted = []
        for seq in sorted(self.running, key=lambda s: s.admitted_at):
            if seq.slot is None:  # preempted earlier in this loop
                continue
            need = pages_for(self.kv_after_chunk(seq, k), self.page_size) - len(seq.pages)
            while need > 0:
                shard = self.shard_of(seq.slot)
                try:
                    seq.pages += self._alloc(shard, need)
                    self._set_table(seq)
                    need = 0
                except OutOfPages:
                    if self._make_room(shard, need):
                        continue
                    victim = max(
                        (s for s in self.running if self.shard_of(s.slot) == shard),
                        key=lambda s: s.admitted_at,
                    )
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
        return preempted

    # --- 1b. pack running sequences into each shard's lowest slots ----------------------

    def compact(self) -> int:
        """Moves running sequences into the lowest free slots of their shard, so decode can
        run on the first `occupied_width()` slots of each shard (sampler.decode_widths).
        Returns how many moved. Free: the mirrors hold every slot field (lengths and last
        tokens are updated by `record`) and a token's random draw depends on its sequence,
        not its slot, so a moved sequence samples what it would have where it was."""
        moved = 0
        for shard in range(self.num_shards):
            slots = self._shard_slots(shard)
            free = [s for s in slots if self.slots[s] is None]
            taken = [s for s in reversed(slots) if self.slots[s] is not None]
            for dst, src in zip(free, taken):
                if dst > src:
                    break
                self._move(src, dst)
                moved += 1
        return moved

    def _move(self, src: int, dst: int) -> None:
        seq = self.slots[src]
        for name in SLOT_FIELDS:
            self.mirror[name][dst] = self.mirror[name][src]
        self.slots[dst], self.slots[src] = seq, None
        seq.slot = dst
        self.mirror["active"][src] = False
        self.mirror["block_tables"][src] = self._null(src)
        self.dirty = True

    def occupied_width(self) -> int:
        """1 + the highest occupied slot index within a shard, over the shards (0: none)."""
        per = self.slots_per_shard
        return max((s % per + 1 for s, seq in enumerate(self.slots) if seq is not None), default=0)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft([seq])

    def _release(self, seq: Sequence) -> None:
        slot = seq.slot
        self._free(seq)
        self.slots[slot] = None
        self.mirror["active"][slot] = False
        self.mirror["block_tables"][slot] = self._null(slot)
        seq.slot = None
        self.dirty = True

    # --- 2. admission ---------------------------------------------------------------------

    def admit(self, k: int, version: int) -> tuple[list[PrefillRow], list[tuple[int, int]]]:
        """Admits waiting groups in order while slots and pages last.

        Returns the prefill rows and the (src, dst) page copies the driver must run, in that
        order, before the next decode chunk.
        """
        rows, copies = [], []
        while self.waiting:
            group = self.waiting[0]
            placed = self._place(group, k, version, rows, copies)
            if placed == 0:
                break
            if placed == len(group):
                self.waiting.popleft()
            else:
                self.waiting[0] = group[placed:]
        return rows, copies

    def _place(self, group, k, version, rows, copies) -> int:
        """Admits a prefix of `group` into one shard; returns how many were admitted."""
        lead = group[0]
        if lead.cached:
            return self._place_resumed(lead, k, rows)
        kv_prefill = lead.length - 1
        shared = kv_prefill // self.page_size
        partial = kv_prefill % self.page_size > 0
        for shard in sorted(range(self.num_shards), key=self._free_slots_in, reverse=True):
            free = [s for s in self._shard_slots(shard) if self.slots[s] is None]
            # Attempts sharing one prefill must hold identical tokens (fresh attempts do;
            # a preempted sequence is queued alone).
            members = list(
                itertools.takewhile(lambda s: s.all_tokens == lead.all_tokens, group[: len(free)])
            )
            own = [pages_for(self.kv_after_chunk(s, k), self.page_size) - shared for s in members]
            alloc = self.allocators[shard]
            if members:
                self._make_room(shard, shared + sum(own), but=group)
            while members and shared + sum(own) > alloc.num_free:
                members.pop()
                own.pop()
            if not members:
                continue
            shared_pages = self._alloc(shard, shared)
            base = shard * self.pages_per_shard
            for _ in members[1:]:
                alloc.share([p - base for p in shared_pages])
            for seq, slot, n_own in zip(members, free, own):
                seq.slot, seq.shard = slot, shard
                seq.pages = shared_pages + self._alloc(shard, n_own)
                seq.admitted_at = next(self._admissions)
                if seq.start_version is None:
                    seq.start_version = version
                self.slots[slot] = seq
                self._set_table(seq)
                self._load_slot(seq)
            if kv_prefill > 0:
                rows.append(PrefillRow(slot=members[0].slot, tokens=lead.all_tokens[:-1]))
            if partial:
                src = members[0].pages[shared]
                copies.extend((src, seq.pages[shared]) for seq in members[1:])
            return len(members)
        return 0

    def _place_resumed(self, seq: Sequence, k: int, rows: list[PrefillRow]) -> int:
        """A resumed episode back into a slot of the shard holding its pages; only the tokens
        after its cached positions are prefilled. 0 while that shard has no slot or pages."""
        shard = seq.shard
        free = [s for s in self._shard_slots(shard) if self.slots[s] is None]
        if not free:
            return 0
        need = pages_for(self.kv_after_chunk(seq, k), self.page_size) - len(seq.pages)
        if not self._make_room(shard, need, but=[seq]):
            return 0
        seq.slot = free[0]
        seq.pages += self._alloc(shard, max(need, 0))
        seq.admitted_at = next(self._admissions)
        self.slots[seq.slot] = seq
        self._set_table(seq)
        self._load_slot(seq)
        if seq.length - 1 > seq.cached:
            rows.append(PrefillRow(slot=seq.slot, tokens=seq.all_tokens[:-1], start=seq.cached))
        seq.cached = 0
        return 1

    # --- episodes -------------------------------------------------------------------------

    def _park(self, seq: Sequence) -> None:
        slot = seq.slot
        self.slots[slot] = None
        self.mirror["active"][slot] = False
        self.mirror["block_tables"][slot] = self._null(slot)
        seq.slot = None
        seq.cached = seq.length - 1
        self._trim(seq, pages_for(seq.cached, self.page_size))
        self.parked[(seq.request_id, seq.attempt)] = seq
        self.dirty = True

    def _trim(self, seq: Sequence, keep: int) -> None:
        """Frees the pages of `seq` past its first `keep` (reserved for a chunk's steps that
        were not taken, or that decoded tokens a stop string dropped)."""
        if len(seq.pages) > keep:
            base = seq.shard * self.pages_per_shard
            self.allocators[seq.shard].free([p - base for p in seq.pages[keep:]])
            del seq.pages[keep:]

    def resume(self, key: tuple[int, int], tokens: list[int], limit: int) -> Sequence:
        """Appends an observation to a parked episode and queues it first (KeyError if `key`
        is not parked)."""
        seq = self.parked.pop(key)
        seq.tokens.extend(tokens)
        seq.logprobs.extend([0.0] * len(tokens))
        seq.versions.extend([-1] * len(tokens))
        seq.limit, seq.finish_reason = limit, None
        seq.turn_start = len(seq.tokens)
        self.waiting.appendleft([seq])
        return seq

    def drop(self, key: tuple[int, int]) -> None:
        """Ends a parked episode: its pages go back to the pool."""
        self._free(self.parked.pop(key))

    def _make_room(self, shard: int, pages: int, but=()) -> bool:
        """Frees cached pages in `shard` until `pages` are free; True if they are. Parked
        episodes' caches go first, oldest first; then those of resumed episodes still queued
        (not those in `but`, the group being placed), last queued first: while a queued cache
        holds pages the queue's head needs, nothing can start and nothing runs to free them
        (tests/test_sampler_scheduler.py's tight-pool episodes). Either kind is prefilled whole
        when its turn comes, as a preempted sequence is. Counts free pages rather than the
        pages dropped: pages shared with the other attempts of a prompt free with the last."""
        alloc = self.allocators[shard]
        if alloc.num_free >= pages:  # the common case: no scan of the queue at every boundary
            return True
        queued = [s for group in self.waiting for s in group if s.cached and s not in but]
        for seq in [*self.parked.values(), *reversed(queued)]:
            if alloc.num_free >= pages:
                break
            if seq.shard == shard and seq.pages:
                self._free(seq)
                self.evictions += 1
        return alloc.num_free >= pages

    def evict_all_parked(self) -> None:
        """Drops every parked cache, and those of resumed episodes still waiting for a slot
        (kv policy "recompute": they were made by old params)."""
        waiting = [seq for group in self.waiting for seq in group if seq.cached]
        for seq in [*self.parked.values(), *waiting]:
            self._free(seq)

    def _free_slots_in(self, shard: int) -> int:
        return sum(self.slots[s] is None for s in self._shard_slots(shard))

    def _shard_slots(self, shard: int) -> range:
        return range(shard * self.slots_per_shard, (shard + 1) * self.slots_per_shard)

    def _load_slot(self, seq: Sequence) -> None:
        m, slot, p = self.mirror, seq.slot, seq.params
        m["last_token"][slot] = seq.all_tokens[-1]
        m["lengths"][slot] = seq.length
        m["limit"][slot] = seq.limit
        m["active"][slot] = True
        m["temperature"][slot] = p.temperature
        m["top_k"][slot] = p.top_k
        m["top_p"][slot] = p.top_p
        m["stop_tokens"][slot] = -1
        m["stop_tokens"][slot, : len(seq.stop_ids)] = seq.stop_ids
        m["seeds"][slot] = seq.seed
        self.dirty = True

    def recompute_rows(self) -> list[PrefillRow]:
        """Prefill rows that rewrite every running sequence's K/V (kv policy "recompute")."""
        return [
            PrefillRow(slot=s.slot, tokens=s.all_tokens[:-1]) for s in self.running if s.length > 1
        ]

    # --- 4. results of a chunk ------------------------------------------------------------

    def record(self, tokens_BxC, logprobs_BxC, versions_BxC, valid_BxC, active_B) -> list[Sequence]:
        """Appends a chunk's outputs; retires and returns the sequences that finished."""
        finished = []
        counts_B = valid_BxC.sum(axis=1)
        for slot, seq in enumerate(self.slots):
            if seq is None:
                continue
            n = int(counts_B[slot])
            seq.tokens.extend(int(t) for t in tokens_BxC[slot, :n])
            seq.logprobs.extend(float(x) for x in logprobs_BxC[slot, :n])
            seq.versions.extend(int(v) for v in versions_BxC[slot, :n])
            cut = self._stop_string_cut(seq, n)
            if cut is not None:  # even where the device stopped it later in the chunk
                del seq.tokens[cut:], seq.logprobs[cut:], seq.versions[cut:]
            self.mirror["lengths"][slot] = seq.length
            self.mirror["last_token"][slot] = seq.all_tokens[-1]
            if cut is not None or not active_B[slot]:
                seq.finish_reason = (
                    "stop"
                    if cut is not None or (seq.tokens and seq.tokens[-1] in seq.stop_ids)
                    else "length"
                )
                if seq.keep:
                    self._park(seq)
                else:
                    self._release(seq)
                finished.append(seq)
        return finished

    def _stop_string_cut(self, seq: Sequence, n: int) -> int | None:
        """Where `seq`'s tokens end if its current turn's text now holds a stop string (the
        last `n` tokens are this chunk's), else None."""
        stops = seq.params.stop_strings
        if not stops or n == 0 or self.detokenize is None:
            return None
        turn = seq.tokens[seq.turn_start :]
        keep = stop_string_cut(self.detokenize, turn, len(turn) - n, stops)
        return None if keep is None else seq.turn_start + keep

    def check(self) -> None:
        """Invariants for tests: refcounts equal the number of live holders of each page."""
        for shard, alloc in enumerate(self.allocators):
            alloc.check()
            base = shard * self.pages_per_shard
            holders = collections.Counter(
                p - base for s in self.running if self.shard_of(s.slot) == shard for p in s.pages
            )
            queued = [s for group in self.waiting for s in group]  # resumed ones keep pages
            holders.update(
                p - base
                for s in [*self.parked.values(), *queued]
                if s.shard == shard
                for p in s.pages
            )
            for page in range(1, alloc.num_pages):
                if alloc.refcount(page) != holders.get(page, 0):
                    raise AssertionError(
                        f"shard {shard} page {page}: refcount {alloc.refcount(page)} != "
                        f"holders {holders.get(page, 0)}"
                    )
