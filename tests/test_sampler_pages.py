"""Page allocator (refcounts, null page, exhaustion) and KV pool sizing."""

import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.sampler import pages as pg


def test_alloc_free_share_refcounts():
    alloc = pg.PageAllocator(6)
    assert alloc.usable_pages == 5 and alloc.num_free == 5
    a = alloc.alloc(3)
    assert pg.NULL_PAGE not in a and len(set(a)) == 3
    alloc.share(a[:2])
    assert [alloc.refcount(p) for p in a] == [2, 2, 1]
    alloc.free(a)  # the third page returns, the shared ones stay
    assert alloc.num_free == 3 and [alloc.refcount(p) for p in a] == [1, 1, 0]
    alloc.free(a[:2])
    assert alloc.num_free == 5
    alloc.check()


def test_exhaustion_allocates_nothing_and_null_page_is_never_handed_out():
    alloc = pg.PageAllocator(4)
    got = alloc.alloc(2)
    with pytest.raises(pg.OutOfPages):
        alloc.alloc(2)
    assert alloc.num_free == 1  # the failed call took nothing
    got += alloc.alloc(1)
    assert sorted(got) == [1, 2, 3]
    alloc.check()


def test_double_free_and_sharing_free_pages_raise():
    alloc = pg.PageAllocator(4)
    (p,) = alloc.alloc(1)
    alloc.free([p])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([p])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.share([p])
    with pytest.raises(ValueError):
        alloc.free([pg.NULL_PAGE])


def test_pool_sizing_from_pages_and_from_memory():
    kw = dict(num_layers=2, num_kv_heads=2, head_dim=8, itemsize=4, page_size=16, max_seq_len=64)
    per_page = 2 * 2 * 16 * 2 * 8 * 4
    pool = pg.size_pool(num_pages=9, **kw)
    assert pool.bytes_per_page == per_page and pool.total_tokens == 8 * 16
    assert pool.full_length_sequences == 2  # 64 tokens = 4 pages each, 8 usable pages
    from_memory = pg.size_pool(memory_bytes=per_page * 9 + per_page - 1, **kw)
    assert from_memory.num_pages == 9
    line = pg.describe_pool(pool, num_slots=4)
    assert "2 sequences of max_seq_len=64" in line and "4 slots x 32 tokens" in line
    assert "preempted" in line


def test_pool_sizing_errors():
    kw = dict(num_layers=2, num_kv_heads=2, head_dim=8, itemsize=4, max_seq_len=64)
    with pytest.raises(ConfigError, match="exactly one"):
        pg.size_pool(page_size=16, **kw)
    with pytest.raises(ConfigError, match="raise the budget"):
        pg.size_pool(page_size=16, memory_bytes=100, **kw)
    with pytest.raises(ConfigError, match="multiple of 8"):
        pg.size_pool(page_size=12, num_pages=4, **kw)
    with pytest.raises(ConfigError, match="null page"):
        pg.PageAllocator(1)
