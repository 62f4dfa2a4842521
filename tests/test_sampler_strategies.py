"""The decode attention strategies (sampler/strategies.py) and the free device steps (sampler/steps.py).

* every strategy ("staged", "paged", "gather") decodes the same tokens and logprobs over
  several chunks from the same `state_from_prompts` state (fresh random params and prompts,
  f32 and bf16 caches, greedy and sampled), and leaves the same pool behind;
* the free `decode_chunk` under jax.jit equals the Engine's (shard_map over a 1-device mesh);
* `state_from_prompts` + greedy `decode_chunk` equals the model's own full forward
  (`decoder.jit_forward`) argmax token by token, logprobs its log_softmax, for every strategy;
* the CPU strategies store 16-bit pools as uint16 bit patterns (a CPU trick), and no
  compiled decode chunk or prefill copies or converts the pool.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.models import decoder
from pipelinerl_jax.sampler import attend as attn
from pipelinerl_jax.sampler import engine, steps, strategies
from pipelinerl_jax.sampler.steps import EngineConfig
from tests.tiny_models import model_config

CFG = model_config(vocab_size=96)
PAGE, WIDTH, SLOTS = 8, 6, 4  # a slot holds 48 positions
STEPS, CHUNKS = 4, 3
WINDOW = 4  # pages: covers the longest sequence below (17 + 12 tokens)
PROMPT_LENGTHS = (3, 11, 17, 1)  # 17: over two pages; 1: nothing to prefill
NAMES = ("staged", "paged", "gather")

decode_jit = jax.jit(
    steps.decode_chunk,
    static_argnames=("cfg", "ecfg", "k", "window", "axes"),
    donate_argnames=("state",),
)


prefill_jit = jax.jit(
    steps.prefill, static_argnames=("cfg", "ecfg", "window"), donate_argnames=("state",)
)


def _ecfg(attention, cache_dtype="float32"):
    return EngineConfig(
        num_slots=SLOTS,
        page_size=PAGE,
        num_pages=1 + SLOTS * WIDTH,
        pages_per_slot=WIDTH,
        max_stop_tokens=2,
        cache_dtype=cache_dtype,
        attention=attention,
    )


@pytest.fixture(scope="module")
def model():
    graphdef, params = decoder.init(CFG, jax.random.key(3))
    # Scaled up from the init's std 0.02 so that logits are peaked: greedy has no near-ties
    # for 1e-6 differences between layouts to break, and sampling is still random.
    return graphdef, jax.tree.map(lambda x: x * 5, params)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]


def _decode(model_params, prompts, attention, cache_dtype="float32", temperature=0.0):
    """CHUNKS chunks of STEPS steps with the free functions; host copies of the outputs."""
    ecfg = _ecfg(attention, cache_dtype)
    params = steps.prepare_params(model_params, cfg=CFG, ecfg=ecfg)
    state = steps.state_from_prompts(
        params,
        prompts,
        cfg=CFG,
        ecfg=ecfg,
        chunk_steps=STEPS,
        max_new_tokens=STEPS * CHUNKS,
        temperature=temperature,
        seed=5,
    )
    outs = []
    for chunk in range(CHUNKS):
        state = decode_jit(params, state, chunk, cfg=CFG, ecfg=ecfg, k=STEPS, window=WINDOW)
        outs.append(
            jax.device_get(
                (state.out_tokens, state.out_logprobs, state.out_valid, state.out_versions)
            )
        )
    tokens, logprobs, valid, versions = (np.concatenate(x, axis=1) for x in zip(*outs))
    pools = [np.asarray(p, np.float32) for p in steps.pool_values(state, ecfg)]
    return dict(tokens=tokens, logprobs=logprobs, valid=valid, versions=versions, pools=pools)


def test_pick_resolves_auto_and_names_layouts():
    assert strategies.resolve("auto") == "staged"  # no Triton kernel on this CPU
    assert strategies.pick("auto", "bfloat16") == strategies.StagedAttention("bfloat16")
    layouts = {name: strategies.pick(name).layout for name in NAMES}
    assert layouts == {"staged": "feature_major", "paged": "token_major", "gather": "feature_major"}
    assert strategies.pick("paged").scatter is attn.plain_set
    assert strategies.pick("staged").scatter is attn.set_at
    assert steps.ATTENTION_IMPLS == ("auto", "staged", "paged", "gather")
    with pytest.raises(ValueError, match="attention='flash'"):
        strategies.pick("flash")


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_every_strategy_decodes_the_same(model, prompts, cache_dtype):
    _, params = model
    for temperature in (0.0, 1.0):
        runs = {name: _decode(params, prompts, name, cache_dtype, temperature) for name in NAMES}
        want = runs["staged"]
        assert want["valid"].all()  # every prompt decoded all 3 chunks
        np.testing.assert_array_equal(
            want["versions"], np.tile(np.repeat(np.arange(CHUNKS), STEPS), (SLOTS, 1))
        )
        if temperature:
            assert len({tuple(row) for row in want["tokens"]}) == SLOTS
        for name in NAMES[1:]:
            got = runs[name]
            for key in ("tokens", "valid", "versions"):
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
            # bf16 pools: one rounding of nearly equal f32 values (the layouts' K/V) may differ
            # by an ulp, which moves a logprob by ~1e-5. On a Xeon with AMX, XLA:CPU also runs
            # some layouts' bf16 dots through AMX and others not (another accumulation order):
            # logprobs then differ by up to ~1.5e-3 (bf16 keeps 8 bits, 3.9e-3 relative), with
            # the same tokens.
            tol = 1e-5 if cache_dtype == "float32" else 5e-3
            np.testing.assert_allclose(got["logprobs"], want["logprobs"], rtol=tol, atol=tol)
            # The pool is the one source of truth: every strategy leaves the same K/V behind.
            # f32: to rounding, since the layouts' projections ([O, I] or [I, O]) may sum in
            # another order (measured up to 6e-5 relative with XLA's elemental emitters).
            rtol, atol = (1e-4, 1e-5) if cache_dtype == "float32" else (1e-2, 1e-2)
            for got_pool, want_pool in zip(got["pools"], want["pools"]):
                np.testing.assert_allclose(got_pool, want_pool, rtol=rtol, atol=atol)


def test_free_decode_chunk_under_jit_matches_the_engine(model, prompts):
    graphdef, params = model
    ecfg = _ecfg("auto")
    eng = engine.get_engine(graphdef, ecfg)
    assert eng.attention == strategies.resolve("auto") and eng.strategy.layout == "feature_major"
    free_params = steps.prepare_params(params, cfg=CFG, ecfg=ecfg)
    engine_params = eng.prepare_params(params)
    jax.tree.map(np.testing.assert_array_equal, engine_params, free_params)
    sampled = functools.partial(
        steps.state_from_prompts,
        cfg=CFG,
        ecfg=ecfg,
        chunk_steps=STEPS,
        temperature=1.0,
        top_p=0.9,
        stop_tokens=(7,),
    )
    free_state = sampled(free_params, prompts)
    engine_state = sampled(free_params, prompts)
    decode = jax.jit(
        functools.partial(steps.decode_chunk, cfg=CFG, ecfg=ecfg, k=STEPS, window=WINDOW)
    )
    for version in range(CHUNKS):
        free_state = decode(free_params, free_state, version)
        engine_state = eng.decode_chunk(
            engine_params, engine_state, np.int32(version), k=STEPS, window=WINDOW
        )
        for field in ("out_tokens", "out_valid", "out_versions", "lengths", "active"):
            np.testing.assert_array_equal(
                getattr(free_state, field), getattr(engine_state, field), err_msg=field
            )
        np.testing.assert_allclose(
            free_state.out_logprobs, engine_state.out_logprobs, rtol=1e-6, atol=1e-6
        )
    np.testing.assert_allclose(free_state.k_pages, engine_state.k_pages, rtol=1e-6, atol=1e-6)


def _greedy_reference(graphdef, params, prompts, steps):
    """Greedy tokens and logprobs from the model's full forward over each growing sequence
    (padded to one length: later tokens never reach earlier positions)."""
    length = max(map(len, prompts)) + steps
    seqs = [list(p) for p in prompts]
    tokens, logprobs, gaps = [[] for _ in prompts], [[] for _ in prompts], []
    positions = jnp.broadcast_to(jnp.arange(length), (len(prompts), length))
    for _ in range(steps):
        padded = np.zeros((len(prompts), length), np.int32)
        for b, seq in enumerate(seqs):
            padded[b, : len(seq)] = seq
        logits = np.asarray(decoder.jit_forward(graphdef, params, jnp.asarray(padded), positions))
        for b, seq in enumerate(seqs):
            row = logits[b, len(seq) - 1].astype(np.float64)
            token = int(np.argmax(row))
            top2 = np.sort(row)[-2:]
            gaps.append(top2[1] - top2[0])
            logprobs[b].append(row[token] - np.log(np.sum(np.exp(row - row.max()))) - row.max())
            tokens[b].append(token)
            seq.append(token)
    return np.asarray(tokens), np.asarray(logprobs), min(gaps)


@pytest.mark.parametrize("attention", NAMES)
def test_state_from_prompts_decodes_like_the_full_forward(model, prompts, attention):
    graphdef, params = model
    want_tokens, want_logprobs, gap = _greedy_reference(graphdef, params, prompts, STEPS * CHUNKS)
    assert gap > 1e-3, "near-tied logits: pick another seed"
    got = _decode(params, prompts, attention)
    np.testing.assert_array_equal(got["tokens"], want_tokens)
    np.testing.assert_allclose(got["logprobs"], want_logprobs, rtol=1e-4, atol=1e-5)


def test_state_from_prompts_assigns_slots_and_pages(model, prompts):
    _, params = model
    ecfg = _ecfg("staged")
    dparams = steps.prepare_params(params, cfg=CFG, ecfg=ecfg)
    state = steps.state_from_prompts(
        dparams, prompts[:3], cfg=CFG, ecfg=ecfg, max_new_tokens=5, stop_tokens=(1, 2)
    )
    tables = np.asarray(state.block_tables)
    lengths = [len(p) for p in prompts[:3]]
    np.testing.assert_array_equal(state.lengths[:3], lengths)
    np.testing.assert_array_equal(state.limit[:3], [n + 5 for n in lengths])
    np.testing.assert_array_equal(state.last_token[:3], [p[-1] for p in prompts[:3]])
    np.testing.assert_array_equal(state.active, [True, True, True, False])
    np.testing.assert_array_equal(state.stop_tokens[0], [1, 2])
    # K/V is written for positions < limit - 1: pages_for(n + 4) each, distinct, never null.
    pages = [-(-(n + 4) // PAGE) for n in lengths]
    assert [np.count_nonzero(row) for row in tables] == pages + [0]
    used = tables[tables > 0]
    assert len(set(used.tolist())) == len(used) == sum(pages)
    # The prompts' K/V (all but the last token) landed in their pages; empty slots in none.
    k_pages = np.asarray(state.k_pages)
    for b, n in enumerate(lengths):
        cached = [k_pages[:, tables[b, pos // PAGE], :, pos % PAGE] for pos in range(n - 1)]
        assert all(np.abs(c).sum() > 0 for c in cached)
    with pytest.raises(ValueError, match="num_slots"):
        steps.state_from_prompts(dparams, prompts * 2, cfg=CFG, ecfg=ecfg)
    with pytest.raises(ValueError, match="a slot holds"):
        steps.state_from_prompts(dparams, [[1] * WIDTH * PAGE], cfg=CFG, ecfg=ecfg)
    with pytest.raises(ValueError, match="num_pages"):
        steps.state_from_prompts(dparams, [[1]] * SLOTS, cfg=CFG, ecfg=_small_pool())


def _small_pool():
    return EngineConfig(
        num_slots=SLOTS, page_size=PAGE, num_pages=4, pages_per_slot=WIDTH, max_stop_tokens=2
    )


@pytest.mark.parametrize("attention, bits", [("staged", True), ("gather", True), ("paged", False)])
def test_only_the_cpu_strategies_store_bit_patterns(model, prompts, attention, bits):
    """bf16 pools: the CPU strategies store and scatter uint16 bit patterns; the paged (GPU)
    strategy keeps a bf16 pool written with a plain .at[].set (StableHLO, before any XLA
    rewrite). Either way `pool_values` reads back the same bf16 K/V."""
    _, params = model
    ecfg = _ecfg(attention, "bfloat16")
    dparams = steps.prepare_params(params, cfg=CFG, ecfg=ecfg)
    state = steps.state_from_prompts(dparams, prompts, cfg=CFG, ecfg=ecfg, chunk_steps=2)
    assert state.k_pages.dtype == (jnp.uint16 if bits else jnp.bfloat16) == steps.pool_dtype(ecfg)
    assert all(p.dtype == jnp.bfloat16 for p in steps.pool_values(state, ecfg))
    text = decode_jit.lower(dparams, state, 0, cfg=CFG, ecfg=ecfg, k=2, window=WINDOW).as_text()
    assert ("xui16>" in text) == bits


# Not the GPU strategy's bf16 pool: XLA:CPU upcasts its plain bf16 scatter (set_at says why).
@pytest.mark.parametrize(
    "attention, cache_dtype",
    [(name, "float32") for name in NAMES] + [("staged", "bfloat16"), ("gather", "bfloat16")],
)
def test_no_compiled_chunk_or_prefill_copies_the_pool(model, prompts, attention, cache_dtype):
    """Each hook writes its layer's K/V before it reads the pool: reading first made XLA copy
    the whole pool per layer and step (attend.py). 16-bit pools: stored as the bits the CPU
    strategies scatter, so no call converts the pool between views either (a per-call view
    was a copy of the pool on entry and on exit)."""
    _, params = model
    ecfg = _ecfg(attention, cache_dtype)
    dparams = steps.prepare_params(params, cfg=CFG, ecfg=ecfg)
    state = steps.state_from_prompts(dparams, prompts, cfg=CFG, ecfg=ecfg, chunk_steps=2)
    rows = (np.ones((SLOTS, PAGE), np.int32), np.zeros((SLOTS, PAGE), np.int32))
    compiled = [
        decode_jit.lower(dparams, state, 0, cfg=CFG, ecfg=ecfg, k=2, window=WINDOW),
        prefill_jit.lower(dparams, state, *rows, state.block_tables, cfg=CFG, ecfg=ecfg, window=2),
    ]
    pool = ",".join(str(d) for d in state.k_pages.shape)
    # The state is donated to both: without donation the pool is copied once, into the output.
    for lowered in compiled:
        hlo = lowered.compile().as_text()
        assert not re.findall(r"\[" + pool + r"\]\{[^}]*\} (copy|convert|bitcast-convert)\(", hlo)
