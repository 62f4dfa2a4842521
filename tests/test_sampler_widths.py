"""sampler.decode_widths: running sequences packed into the lowest slots, decode run on the
narrowest batch that holds them.

A narrow chunk must decode its rows exactly as the full-width chunk does (and leave the other
rows alone), packing must move a sequence's whole slot (the fake device of
test_sampler_scheduler checks every page's content), and a sampler that narrows must return
the samples of one that does not (same tokens and versions, logprobs to float rounding: the
matmuls run at another row count), through an in-flight weight swap and on two data shards,
while decoding fewer slot-steps.
"""

import dataclasses
import functools
import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder
from pipelinerl_jax.models.tiny_model import tiny_config
from pipelinerl_jax.sampler import steps
from pipelinerl_jax.sampler.config import SamplerConfig, width_ladder
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.scheduler import Scheduler
from pipelinerl_jax.sampler.sequence import SamplingParams
from tests.test_sampler_scheduler import STOP, VOCAB, FakeDevice, make_seqs, solo
from tests.xla_env import child_env

MODEL = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, head_dim=16)
# One attention window (the whole table), so each width is one compile.
SAMPLER = SamplerConfig(
    num_slots=8, max_seq_len=48, page_size=8, chunk_steps=4, prefill_chunk=16, min_window_pages=6
)


def test_a_narrow_chunk_decodes_its_rows_as_the_full_chunk_does():
    graphdef, model_params = decoder.init(MODEL, jax.random.key(0))
    ecfg = steps.EngineConfig(
        num_slots=8, page_size=8, num_pages=48, pages_per_slot=6, max_stop_tokens=2
    )
    params = steps.prepare_params(model_params, cfg=MODEL, ecfg=ecfg)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, MODEL.vocab_size, rng.integers(2, 12)).tolist() for _ in range(3)]

    def start():
        return steps.state_from_prompts(
            params,
            prompts,
            cfg=MODEL,
            ecfg=ecfg,
            chunk_steps=5,
            max_new_tokens=20,
            temperature=1.0,
            seeds=[4, 5, 6],
        )

    @functools.partial(jax.jit, static_argnames="width")
    def chunk(state, width):
        return steps.decode_chunk(
            params, state, 7, cfg=MODEL, ecfg=ecfg, k=5, window=6, width=width
        )

    full, narrow = chunk(start(), None), chunk(start(), 4)
    # Rows that are not active sample nothing valid (the full chunk's are garbage).
    valid = np.asarray(full.out_valid)
    assert valid[:3].all() and not valid[3:].any()
    mask = lambda state: np.where(valid, state.out_tokens, 0)  # noqa: E731
    assert np.array_equal(mask(full), mask(narrow))
    for name in (
        "out_versions",
        "out_valid",
        "lengths",
        "last_token",
        "active",
        "block_tables",
        "seeds",
        "limit",
    ):
        assert np.array_equal(getattr(full, name), getattr(narrow, name)), name
    assert (np.asarray(narrow.out_versions)[3:] == -1).all()
    np.testing.assert_allclose(
        np.where(valid, narrow.out_logprobs, 0.0),
        np.where(valid, full.out_logprobs, 0.0),
        atol=1e-5,
    )
    np.testing.assert_allclose(narrow.k_pages, full.k_pages, atol=1e-5)
    np.testing.assert_allclose(narrow.v_pages, full.v_pages, atol=1e-5)
    # A second chunk on the narrow state goes on as the full one does.
    again_full, again_narrow = chunk(full, None), chunk(narrow, 4)
    valid = np.asarray(again_full.out_valid)
    assert valid[:3].any()
    assert np.array_equal(mask(again_full), mask(again_narrow))


@pytest.mark.parametrize("shards", [1, 2])
def test_packing_moves_whole_slots_and_every_sequence_ends_as_it_would_alone(shards):
    rng = np.random.default_rng(shards)
    sched = Scheduler(
        num_slots=8,
        num_pages=40,
        page_size=4,
        pages_per_slot=12,
        max_stop_tokens=2,
        num_shards=shards,
    )
    for rid in range(14):
        prompt = rng.integers(0, VOCAB, size=rng.integers(1, 12)).tolist()
        sched.enqueue(
            make_seqs(
                rid,
                prompt,
                n=int(rng.integers(1, 4)),
                max_new=int(rng.integers(1, 30)),
                capacity=sched.capacity_tokens(),
            )
        )
    dev, finished, moves, widths = FakeDevice(sched), [], 0, []
    while sched.has_work():
        sched.reserve(3)
        moves += sched.compact()
        per = sched.slots_per_shard
        for shard in range(shards):  # packed: a shard's running slots are its lowest ones
            used = [s % per for s in range(shard * per, (shard + 1) * per) if sched.slots[s]]
            assert used == list(range(len(used)))
        for seq in sched.running:  # the mirror row moved with the sequence
            assert sched.mirror["lengths"][seq.slot] == seq.length
            assert sched.mirror["active"][seq.slot]
        widths.append(sched.occupied_width())
        rows, copies = sched.admit(3, version=0)
        dev.prefill(rows)
        dev.copy(copies)
        sched.check()
        dev.verify()  # every running sequence's pages hold its own tokens
        finished += sched.record(*dev.decode(3))
    assert moves > 0 and min(widths[1:]) < sched.slots_per_shard
    for seq in finished:
        assert seq.tokens == solo(seq.prompt, seq.limit, (STOP,))


def _workload(seed):
    """Prompts with budgets from 2 to 30 new tokens: the batch empties unevenly."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(0, MODEL.vocab_size, rng.integers(2, 14)).tolist(),
            SamplingParams(temperature=1.0, max_new_tokens=int(rng.integers(2, 31)), seed=i),
        )
        for i in range(12)
    ]


def _drive(sampler, workload, swap_params):
    """Submits in two waves and swaps params in flight after the third chunk."""
    samples, chunks = [], 0
    for prompt, params in workload[:8]:
        sampler.submit(prompt, n=1, params=params)
    while sampler.has_work():
        samples += sampler.step()
        chunks += 1
        if chunks == 3:
            sampler.set_params(swap_params, version=1)
            for prompt, params in workload[8:]:
                sampler.submit(prompt, n=1, params=params)
    return sorted(samples, key=lambda s: s.request_id)


def test_a_narrowing_sampler_returns_the_samples_of_a_full_width_one():
    graphdef, v0 = decoder.init(MODEL, jax.random.key(2))
    _, v1 = decoder.init(MODEL, jax.random.key(3))
    full = PagedSampler(graphdef, v0, SAMPLER)
    narrow = PagedSampler(graphdef, v0, dataclasses.replace(SAMPLER, decode_widths=3))
    want = _drive(full, _workload(4), v1)
    compiled = full.engine.decode_chunk._cache_size()
    got = _drive(narrow, _workload(4), v1)
    assert narrow.engine is full.engine  # the widths are compiles of one engine
    assert len(got) == len(want) == 12
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and a.versions == b.versions
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert {v for s in got for v in s.versions} == {0, 1}
    assert narrow.stats["decode_tokens"] == full.stats["decode_tokens"]
    assert narrow.stats["decode_slot_steps"] < full.stats["decode_slot_steps"]
    assert full.stats["decode_slot_steps"] == full.stats["chunks"] * 8 * SAMPLER.chunk_steps
    assert narrow.engine.decode_chunk._cache_size() > compiled


def test_decode_widths_below_one_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="decode_widths=0"):
        dataclasses.replace(SAMPLER, decode_widths=0)


def test_more_widths_than_the_slots_halve_into_are_refused_not_capped():
    assert width_ladder(16, 3) == [16, 8, 4] and width_ladder(12, 5) == [12, 6, 3]
    with pytest.raises(ConfigError, match=r"num_slots=12 halves into 3 widths \(12, 6, 3\)"):
        dataclasses.replace(SAMPLER, num_slots=12, decode_widths=4)
    # Over data shards the bound is a shard's slots: 8 over 2 shards halve into (4, 2, 1).
    config = dataclasses.replace(SAMPLER, num_slots=8, decode_widths=4)
    config.check_shards(1)
    with pytest.raises(ConfigError, match=r"over 2 data shards \(4 each\) halves into 3"):
        config.check_shards(2)
    with pytest.raises(ConfigError, match="num_slots=8 must divide by the sampler's 3 data"):
        config.check_shards(3)


CHILD = textwrap.dedent(
    """
    import dataclasses, json, sys
    import jax, numpy as np
    from pipelinerl_jax import sharding
    from pipelinerl_jax.models import decoder
    from pipelinerl_jax.sampler.sampler import PagedSampler
    from tests.test_sampler_widths import MODEL, SAMPLER, _drive, _workload
    mesh = sharding.make_mesh((2,), ("data",), jax.devices()[:2])
    graphdef, v0 = decoder.init(MODEL, jax.random.key(2))
    _, v1 = decoder.init(MODEL, jax.random.key(3))
    out = {}
    for widths in (1, 2):
        s = PagedSampler(graphdef, v0, dataclasses.replace(SAMPLER, decode_widths=widths),
                         mesh=mesh)
        got = _drive(s, _workload(5), v1)
        out[widths] = dict(tokens=[x.token_ids for x in got], versions=[x.versions for x in got],
                           logprobs=[x.logprobs for x in got], slot_steps=s.stats["decode_slot_steps"])
    print(json.dumps(out))
    """
)


def test_two_data_shards_narrow_each_shard_alike():
    env = child_env(2)
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    full, narrow = out["1"], out["2"]
    assert narrow["tokens"] == full["tokens"] and narrow["versions"] == full["versions"]
    for a, b in zip(narrow["logprobs"], full["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert narrow["slot_steps"] < full["slot_steps"]


def test_warm_up_compiles_every_width_so_none_compiles_mid_run():
    from pipelinerl_jax.pipeline.compile_watch import CompileWatch

    graphdef, params = decoder.init(MODEL, jax.random.key(6))
    config = dataclasses.replace(SAMPLER, decode_widths=3, prefill_pad_tokens=True)
    sampler = PagedSampler(graphdef, params, config)
    assert sampler.warm_up() == 4 + 3  # prefill rows 1, 2, 4, 8; decode widths 8, 4, 2
    watch = CompileWatch().install()
    try:
        got = _drive(sampler, _workload(7), params)
        compiled, _ = watch.take()
    finally:
        watch.uninstall()
    assert compiled == 0 and len(got) == 12
    assert sampler.stats["decode_slot_steps"] < sampler.stats["chunks"] * 8 * config.chunk_steps
