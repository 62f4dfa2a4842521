"""Host-side page allocator for the paged KV cache, and sizing of the page pool.

The KV cache is one pool of fixed-size pages shared by every slot. Page 0 is the *null page*:
never handed out, it is where inactive slots and padding tokens write their K/V and what unused
block-table entries point to, so a finished or empty slot can never write into a page another
sequence owns. Pages carry reference counts so that the n attempts of a group can share the
full pages of their prompt (prefilled once) and each free them independently.

Sizing: a page holds K and V for every layer, i.e. 2 * L * S * K * D * itemsize bytes; the pool
is sized from a page count or from a memory budget (`size_pool`; `sampler_pool` resolves a
SamplerConfig the one way the sampler, the memory estimate and the GPU planner all read it),
and `describe_pool` says how many sequences of which length fit.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pipelinerl_jax.errors import ConfigError

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """Raised by `PageAllocator.alloc` when the free list is too short (callers preempt)."""


class PageAllocator:
    """Free list plus per-page reference counts over pages 1..num_pages-1 (0 is the null page)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ConfigError(
                f"num_pages={num_pages}: the KV pool needs at least 2 pages (page 0 is reserved "
                "as the null page); raise num_pages or the KV memory budget"
            )
        self.num_pages = num_pages
        # Lowest pages first: pop() from the end of a reversed list is O(1).
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._refs = [0] * num_pages

    @property
    def usable_pages(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.usable_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, n: int) -> list[int]:
        """n fresh pages with refcount 1; raises OutOfPages (allocating nothing) if too few."""
        if n < 0:
            raise ValueError(f"alloc: n={n} must be >= 0")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Adds one reference to each page (another sequence now reads them too)."""
        for p in pages:
            if p == NULL_PAGE or self._refs[p] <= 0:
                raise ValueError(f"share: page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one reference per page; pages reaching zero return to the free list."""
        for p in pages:
            if p == NULL_PAGE or self._refs[p] <= 0:
                raise ValueError(f"free: page {p} is not allocated (double free?)")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def check(self) -> None:
        """Invariant check for tests: free pages have refcount 0, none is listed twice."""
        free = set(self._free)
        if len(free) != len(self._free) or NULL_PAGE in free:
            raise AssertionError("free list corrupt")
        for p in range(1, self.num_pages):
            if (p in free) != (self._refs[p] == 0):
                raise AssertionError(
                    f"page {p}: refcount {self._refs[p]}, in free list {p in free}"
                )


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold num_tokens positions."""
    return -(-num_tokens // page_size)


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """The resolved pool: page count, page size and what it costs and holds."""

    num_pages: int  # including the null page
    page_size: int  # tokens per page (S)
    bytes_per_page: int  # K and V for every layer
    max_seq_len: int  # context limit of one sequence

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def full_length_sequences(self) -> int:
        """Sequences of max_seq_len that fit at once."""
        return (self.num_pages - 1) // pages_for(self.max_seq_len, self.page_size)

    @property
    def total_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size


def bytes_per_page(
    *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> int:
    return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize


def size_pool(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int,
    page_size: int,
    max_seq_len: int,
    num_pages: int | None = None,
    memory_bytes: int | None = None,
) -> PoolSize:
    """Resolves the pool from a page count or a memory budget (exactly one of them)."""
    if page_size < 1 or page_size % 8:
        raise ConfigError(f"page_size={page_size} must be a positive multiple of 8 (16 is usual)")
    if (num_pages is None) == (memory_bytes is None):
        raise ConfigError("size the KV pool with exactly one of num_pages or kv_memory_bytes")
    per_page = bytes_per_page(
        num_layers=num_layers,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        itemsize=itemsize,
    )
    if num_pages is None:
        num_pages = int(memory_bytes // per_page)
        if num_pages < 2:
            raise ConfigError(
                f"kv_memory_bytes={memory_bytes} holds {num_pages} pages of {per_page} bytes; "
                "the pool needs at least 2 (one is the null page): raise the budget"
            )
    pool = PoolSize(
        num_pages=num_pages, page_size=page_size, bytes_per_page=per_page, max_seq_len=max_seq_len
    )
    if num_pages < 2:
        raise ConfigError(f"num_pages={num_pages} must be >= 2 (page 0 is the null page)")
    return pool


def cache_dtype(sampler_cfg, model_cfg) -> str:
    """The dtype a sampler (`sampler_cfg`, a SamplerConfig) caches K and V in: its cache_dtype,
    else its compute_dtype, else the model's compute dtype."""
    s = sampler_cfg
    return s.cache_dtype or s.compute_dtype or model_cfg.compute_dtype


def sampler_pool(sampler_cfg, model_cfg, *, shards: int = 1) -> PoolSize:
    """The pool a PagedSampler builds for `sampler_cfg` (a SamplerConfig) over `shards` data
    shards: num_pages, or kv_memory_bytes' worth, or room for max_seq_len in every slot plus
    one null page a shard; rounded down to a multiple of shards (each holds an equal share).
    Cached in `cache_dtype(sampler_cfg, model_cfg)`."""
    s = sampler_cfg
    num_pages = s.num_pages
    if num_pages is None and s.kv_memory_bytes is None:
        num_pages = s.num_slots * max_pages_per_slot(s.max_seq_len, s.page_size) + shards
    pool = size_pool(
        num_layers=model_cfg.num_layers,
        num_kv_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim,
        itemsize=np.dtype(cache_dtype(s, model_cfg)).itemsize,
        page_size=s.page_size,
        max_seq_len=s.max_seq_len,
        num_pages=num_pages,
        memory_bytes=None if num_pages is not None else s.kv_memory_bytes,
    )
    num_pages = pool.num_pages - pool.num_pages % shards
    if num_pages // shards < 2:
        raise ConfigError(
            f"KV pool of {pool.num_pages} pages is too small for {shards} "
            "data shards (each needs a null page and one more)"
        )
    return dataclasses.replace(pool, num_pages=num_pages)


def describe_pool(pool: PoolSize, num_slots: int) -> str:
    """One log line: memory, tokens, and how many sequences of what length fit."""
    per_slot = pool.total_tokens // max(num_slots, 1)
    return (
        f"KV pool: {pool.num_pages - 1} pages x {pool.page_size} tokens = "
        f"{pool.total_tokens} tokens, {pool.total_bytes / 2**20:.1f} MiB; fits "
        f"{pool.full_length_sequences} sequences of max_seq_len={pool.max_seq_len}, or "
        f"{num_slots} slots x {per_slot} tokens"
        + (
            ""
            if per_slot >= pool.max_seq_len
            else " (slots that all run to max_seq_len will be preempted)"
        )
    )


def max_pages_per_slot(max_seq_len: int, page_size: int) -> int:
    """Block-table width M: pages covering a full-length sequence."""
    return max(1, math.ceil(max_seq_len / page_size))
