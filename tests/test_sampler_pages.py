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


def test_sampler_pool_resolves_a_sampler_config_one_way():
    """The pool from a SamplerConfig (the sampler, the memory estimate and the GPU planner all
    read it through pages.sampler_pool): default room, a page count, a byte budget, shards."""
    from pipelinerl_jax.sampler.config import SamplerConfig
    from tests.tiny_models import model_config

    m = model_config()  # 2 layers, 2 kv heads of 8, f32
    per_page = 2 * 2 * 16 * 2 * 8 * 4
    default = SamplerConfig(num_slots=3, max_seq_len=40, page_size=16)  # 3 pages a slot
    assert pg.sampler_pool(default, m).num_pages == 3 * 3 + 1  # plus the null page
    assert pg.sampler_pool(default, m, shards=2).num_pages == 3 * 3 + 2 - 1  # rounded to 2s
    pages = SamplerConfig(num_slots=3, max_seq_len=40, page_size=16, num_pages=11)
    assert pg.sampler_pool(pages, m, shards=4).num_pages == 8
    budget = SamplerConfig(num_slots=3, max_seq_len=40, kv_memory_bytes=per_page * 7 + 5)
    pool = pg.sampler_pool(budget, m)
    assert (pool.num_pages, pool.bytes_per_page) == (7, per_page)
    half = SamplerConfig(
        num_slots=3, max_seq_len=40, kv_memory_bytes=per_page * 7, cache_dtype="bfloat16"
    )
    assert pg.sampler_pool(half, m).num_pages == 14  # 2-byte cache: twice the pages
    with pytest.raises(ConfigError, match="too small for 4 data shards"):
        pg.sampler_pool(SamplerConfig(num_slots=1, max_seq_len=16, num_pages=7), m, shards=4)


def test_cache_dtype_is_the_samplers_then_its_compute_then_the_models():
    import dataclasses

    from pipelinerl_jax.sampler.config import SamplerConfig
    from tests.tiny_models import model_config

    m = dataclasses.replace(model_config(), compute_dtype="bfloat16")
    assert pg.cache_dtype(SamplerConfig(), m) == "bfloat16"
    assert pg.cache_dtype(SamplerConfig(compute_dtype="float32"), m) == "float32"
    both = SamplerConfig(compute_dtype="float32", cache_dtype="bfloat16")
    assert pg.cache_dtype(both, m) == "bfloat16"


def test_the_sampler_and_the_memory_estimate_size_one_pool():
    import jax

    from pipelinerl_jax.models import decoder
    from pipelinerl_jax.pipeline import memory
    from pipelinerl_jax.sampler.config import SamplerConfig
    from pipelinerl_jax.sampler.sampler import PagedSampler
    from tests.tiny_models import model_config

    m = model_config()
    graphdef, params = decoder.init(m, jax.random.key(0))
    scfg = SamplerConfig(num_slots=2, max_seq_len=48, page_size=8, cache_dtype="bfloat16")
    sampler = PagedSampler(graphdef, params, scfg)
    assert sampler.pool == pg.sampler_pool(scfg, m)
    assert sampler.state.k_pages.shape[1] == sampler.pool.num_pages

    class _Cfg:  # the fields of a RunConfig the estimate's pool reads
        sampler = scfg

    assert memory._sampler_kv_pool(_Cfg, m) == (sampler.pool, 2)
