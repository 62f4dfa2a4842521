"""Prefill rows and page copies packed into the arrays the engine takes (host side, numpy).

Prefill: a chunk boundary's rows (sequence.PrefillRow) go to the data shard of their slot,
longest first, at most `max_prefill_rows` a shard per call; each shard's rows fill its share
of the batch (padded to a power of two of rows), and a call's tokens are cut into pieces of at
most `prefill_chunk` (the last one padded to a power of two, or to prefill_chunk with
`prefill_pad_tokens`): few shapes, so few compiles. Padding has position -1, which the engine
writes to the null page. A piece attends the pages its rows have cached before it: `window`,
0 for a first piece of new prompts.

Page copies: one fixed [shards x per-shard] shape for every boundary, padded with null -> null
copies: a copy is cheap, a compile per new count is not.

Dimension letters (pipelinerl_jax/__init__.py): R rows, T tokens, M pages per slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from pipelinerl_jax.sampler import pages as pg
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.scheduler import Scheduler
from pipelinerl_jax.sampler.sequence import PrefillRow
from pipelinerl_jax.sampler.statics import pick_window


@dataclasses.dataclass(frozen=True)
class PrefillPiece:
    """One engine.prefill call's arrays; rows [d * R/shards, (d + 1) * R/shards) are shard d's."""

    tokens_RxT: np.ndarray  # int32
    positions_RxT: np.ndarray  # int32, -1 for padding
    tables_RxM: np.ndarray  # int32 global page ids: each row's slot's block table
    window: int  # cached pages each row attends besides the piece itself

    @property
    def num_tokens(self) -> int:
        return int((self.positions_RxT >= 0).sum())


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _nulls(sched: Scheduler, per_shard: int) -> np.ndarray:
    """[shards x per_shard] global ids: each shard's rows at that shard's null page."""
    return np.repeat(np.arange(sched.num_shards, dtype=np.int32) * sched.pages_per_shard, per_shard)


def _null_tables(sched: Scheduler, per_shard: int) -> np.ndarray:
    """Block tables of rows that name only their shard's null page."""
    return _nulls(sched, per_shard)[:, None].repeat(sched.pages_per_slot, axis=1)


def prefill_pieces(
    rows: list[PrefillRow], sched: Scheduler, cfg: SamplerConfig
) -> Iterator[PrefillPiece]:
    """The pieces that prefill `rows` (a row's tokens before its `start` are cached already:
    a resumed episode), in the order they must run."""
    by_shard = [
        sorted(
            (r for r in rows if sched.shard_of(r.slot) == d),
            key=lambda r: -(len(r.tokens) - r.start),
        )
        for d in range(sched.num_shards)
    ]
    while any(by_shard):
        batch = [lst[: cfg.max_prefill_rows] for lst in by_shard]
        by_shard = [lst[cfg.max_prefill_rows :] for lst in by_shard]
        per_shard = pow2_at_least(max(len(lst) for lst in batch))
        longest = max(len(r.tokens) - r.start for lst in batch for r in lst)
        start = 0
        while start < longest:
            remaining = longest - start
            t = (
                cfg.prefill_chunk
                if remaining > cfg.prefill_chunk or cfg.prefill_pad_tokens
                else min(cfg.prefill_chunk, max(cfg.page_size, pow2_at_least(remaining)))
            )
            n_rows = per_shard * sched.num_shards
            tokens = np.zeros((n_rows, t), np.int32)
            positions = np.full((n_rows, t), -1, np.int32)
            tables = _null_tables(sched, per_shard)
            for d, lst in enumerate(batch):
                for i, row in enumerate(lst):
                    at = row.start + start
                    piece = row.tokens[at : at + t]
                    r = d * per_shard + i
                    tokens[r, : len(piece)] = piece
                    positions[r, : len(piece)] = np.arange(at, at + len(piece))
                    tables[r] = sched.mirror["block_tables"][row.slot]
            cached = max(min(row.start + start, len(row.tokens)) for lst in batch for row in lst)
            window = (
                0
                if cached == 0
                else pick_window(pg.pages_for(cached, cfg.page_size), sched.pages_per_slot)
            )
            yield PrefillPiece(tokens, positions, tables, window)
            start += t


def padding_pieces(sched: Scheduler, cfg: SamplerConfig) -> list[PrefillPiece]:
    """With `prefill_pad_tokens`, one all-padding piece of every shape a first piece can take:
    [rows, prefill_chunk] for rows a power of two up to what a shard prefills at once (what
    `PagedSampler.warm_up` runs to compile them). Without it, none: token lengths vary too."""
    if not cfg.prefill_pad_tokens:
        return []
    cap = pow2_at_least(min(cfg.max_prefill_rows, -(-cfg.num_slots // sched.num_shards)))
    out, per_shard = [], 1
    while per_shard <= cap:
        n_rows = per_shard * sched.num_shards
        out.append(
            PrefillPiece(
                np.zeros((n_rows, cfg.prefill_chunk), np.int32),
                np.full((n_rows, cfg.prefill_chunk), -1, np.int32),
                _null_tables(sched, per_shard),
                window=0,
            )
        )
        per_shard *= 2
    return out


def copy_arrays(copies: list[tuple[int, int]], sched: Scheduler) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) global page ids, [shards x per-shard], shard d's copies in its range and
    null -> null pads (at most one copy per slot is ever needed)."""
    by_shard = [
        [c for c in copies if c[0] // sched.pages_per_shard == d] for d in range(sched.num_shards)
    ]
    per_shard = max(sched.num_slots // sched.num_shards, max(len(lst) for lst in by_shard))
    src, dst = _nulls(sched, per_shard), _nulls(sched, per_shard)
    for d, lst in enumerate(by_shard):
        for i, (s, t) in enumerate(lst):
            src[d * per_shard + i], dst[d * per_shard + i] = s, t
    return src, dst
