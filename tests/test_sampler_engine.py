"""Sampler end to end on a tiny random Llama checkpoint made here and loaded with load_hf.

* greedy == transformers greedy `generate` token for token (f32), prompts of different lengths
  (one longer than the prefill chunk) in one continuous batch with more prompts than slots, an
  EOS that stops some sequences mid-batch; logprobs == log_softmax of transformers' logits;
* sampling is independent of batching: a batch equals the same requests run one at a time,
  and group attempts (shared prefill, copied partial page) equal separately submitted ones;
* in-flight param swap between chunks: tokens after the swap follow the new params while the
  old K/V stay (a hand-built dense-cache reference), per-token versions, no recompilation;
  the "recompute" policy equals re-running the new params over the whole prefix.

One sampler shape is shared by all tests (one decode compile); the window is pinned to the
full table (`min_window_pages`) so that no test waits for a second compile.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pipelinerl_jax.models import attention, decoder, hf_io
from pipelinerl_jax.sampler import steps
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.sequence import SamplingParams
from tests.tiny_models import hf_greedy, save_hf_llama

VOCAB, MAX_NEW, MAX_LEN, PAGE = 96, 12, 48, 8
PROMPT_LENGTHS = (3, 9, 17, 26, 1, 12)  # 26 > prefill_chunk: chunked prefill
CONFIG = SamplerConfig(
    num_slots=4,
    max_seq_len=MAX_LEN,
    page_size=PAGE,
    chunk_steps=4,
    prefill_chunk=16,
    max_prefill_rows=4,
    min_window_pages=MAX_LEN // PAGE,
)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    hf_a = save_hf_llama(root / "a", 0, VOCAB)
    save_hf_llama(root / "b", 1, VOCAB)
    _, graphdef, params_a = hf_io.load_hf(root / "a")
    _, _, params_b = hf_io.load_hf(root / "b")
    return hf_a, graphdef, params_a, params_b


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


def test_greedy_matches_transformers_with_eos_mid_batch(models, prompts):
    hf, graphdef, params, _ = models
    free_run, _, _ = hf_greedy(hf, prompts[1], MAX_NEW)
    eos = free_run[4]  # prompt 1 stops after 5 tokens; others may too
    refs = [hf_greedy(hf, p, MAX_NEW, eos=eos) for p in prompts]
    assert min(gap for *_, gap in refs) > 1e-4, "near-tied logits: pick another seed"
    sampler = PagedSampler(graphdef, params, CONFIG, eos_token_ids=(eos,))
    samples = sampler.generate(prompts, params=GREEDY)
    assert sampler.stats["chunks"] > MAX_NEW // CONFIG.chunk_steps  # slots were refilled
    stopped = 0
    for sample, (tokens, logprobs, _) in zip(samples, refs):
        assert sample.token_ids == tokens
        np.testing.assert_allclose(sample.logprobs, logprobs, rtol=1e-4, atol=1e-5)
        want = "stop" if tokens[-1] == eos else "length"
        assert sample.finish_reason == want
        stopped += want == "stop"
        assert sample.versions == [0] * len(tokens) and sample.start_version == 0
    assert 0 < stopped < len(prompts)
    assert len(samples[1].token_ids) <= 5


SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=MAX_NEW)


def test_sampling_batch_equals_one_at_a_time(models, prompts):
    _, graphdef, params, _ = models
    sampler = PagedSampler(graphdef, params, CONFIG)
    seeded = [
        SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=MAX_NEW, seed=100 + i)
        for i in range(len(prompts))
    ]
    for p, sp in zip(prompts, seeded):
        sampler.submit(p, params=sp)
    batch = {}
    while sampler.has_work():
        batch.update({s.request_id: s for s in sampler.step()})
    for i, (p, sp) in enumerate(zip(prompts, seeded)):
        alone = sampler.generate([p], params=sp)[0]
        assert alone.token_ids == batch[i].token_ids
        np.testing.assert_allclose(alone.logprobs, batch[i].logprobs, rtol=1e-5, atol=1e-6)
    distinct = {tuple(s.token_ids) for s in batch.values()}
    assert len(distinct) == len(prompts)


def test_padded_prefill_warms_up_every_shape_and_samples_the_same(models, prompts):
    """prefill_pad_tokens: warm_up() runs one prefill per power-of-two row count (1, 2, 4 rows
    of prefill_chunk tokens) and writes no page but the null one; afterwards prompts of any length up to
    prefill_chunk, admitted 1 to 4 at a time, compile no prefill, and the samples equal those
    of the unpadded sampler (padding sits after a row's tokens, which never attend to it)."""
    from pipelinerl_jax.pipeline.compile_watch import CompileWatch

    _, graphdef, params, _ = models
    short = [p for p in prompts if len(p) <= CONFIG.prefill_chunk]
    seeded = [
        SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=7 + i)
        for i in range(len(short))
    ]
    plain = PagedSampler(graphdef, params, CONFIG)
    expected = [plain.generate([p], params=sp)[0] for p, sp in zip(short, seeded)]
    padded = PagedSampler(graphdef, params, dataclasses.replace(CONFIG, prefill_pad_tokens=True))
    pages_before = [np.asarray(x) for x in (padded.state.k_pages, padded.state.v_pages)]
    assert padded.warm_up() == 3
    for before, after in zip(pages_before, (padded.state.k_pages, padded.state.v_pages)):
        # Padding writes go to the null page 0 ([L, P, K, S, D]), which nothing reads unmasked.
        np.testing.assert_array_equal(before[:, 1:], np.asarray(after)[:, 1:])
    assert PagedSampler(graphdef, params, CONFIG).warm_up() == 0  # unpadded: nothing to warm
    padded.generate([short[0]], params=seeded[0])  # the decode chunk's first use
    watch = CompileWatch().install()
    try:
        got = [padded.generate([p], params=sp)[0] for p, sp in zip(short, seeded)]
        for sp in seeded[:3]:  # 3 rows at once: the 4-row shape
            padded.generate(short[:3], params=sp)
        compiled, _ = watch.take()
    finally:
        watch.uninstall()
    assert compiled == 0
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
        np.testing.assert_allclose(g.logprobs, e.logprobs, rtol=1e-5, atol=1e-6)


def test_group_attempts_share_prefill_and_equal_unshared_admission(models, prompts):
    _, graphdef, params, _ = models
    prompt = prompts[2]  # 17 tokens: 16 cached = 2 full pages shared
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=7)
    sampler = PagedSampler(graphdef, params, CONFIG)
    group = sampler.generate([prompt], n=3, params=sp)
    assert sampler.stats["prefill_tokens"] == len(prompt) - 1  # prefilled once
    assert len({tuple(s.token_ids) for s in group}) == 3
    # Same group while 3 of 4 slots are busy: attempt 0 is admitted alone, 1 and 2 later
    # (their own prefill, sharing with each other): the outputs must not change.
    sampler = PagedSampler(graphdef, params, CONFIG)
    for p in prompts[:3]:
        sampler.submit(p, params=GREEDY)
    rid = sampler.submit(prompt, n=3, params=sp)
    late = sorted((s for s in _drain(sampler) if s.request_id == rid), key=lambda s: s.attempt)
    assert sampler.stats["prefill_tokens"] > sum(len(p) - 1 for p in prompts[:3]) + 16
    for a, b in zip(group, late):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)
    greedy = PagedSampler(graphdef, params, CONFIG).generate([prompt], n=3, params=GREEDY)
    assert greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids


def _drain(sampler):
    out = []
    while sampler.has_work():
        out += sampler.step()
    return out


# --- param swap ------------------------------------------------------------------------------


def _dense_step_fn(graphdef):
    cfg = decoder.config_of(graphdef)

    @jax.jit
    def step(params, cache_k, cache_v, token, pos):
        """One token through the model with a dense [L, MAX_LEN, K, D] cache."""

        def attend(q, k, v, layer_cache):
            ck, cv = layer_cache
            ck, cv = ck.at[pos].set(k[0, 0]), cv.at[pos].set(v[0, 0])
            out = attention.masked_attention(
                q, ck[None], cv[None], (jnp.arange(MAX_LEN) <= pos)[None, None, :]
            )
            return out, (ck, cv)

        hidden, (ck, cv) = decoder.forward_hidden(
            graphdef,
            params,
            jnp.asarray([[token]]),
            jnp.asarray([[pos]]),
            attend=attend,
            cache=(cache_k, cache_v),
        )
        logits = decoder.logits_from_hidden(params, hidden)[0, 0]
        return ck, cv, jnp.argmax(logits)

    def run(params_at_step, prompt, steps):
        """Greedy; the token fed at step i (prompt included) uses params_at_step(i)."""
        shape = (cfg.num_layers, MAX_LEN, cfg.num_kv_heads, cfg.head_dim)
        ck, cv = jnp.zeros(shape), jnp.zeros(shape)
        tokens, out = list(prompt), []
        for i in range(len(prompt) - 1 + steps):
            ck, cv, nxt = step(params_at_step(i), ck, cv, tokens[i], i)
            if i >= len(prompt) - 1:
                tokens.append(int(nxt))
                out.append(int(nxt))
        return out

    return run


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_param_swap_between_chunks(models, prompts, policy):
    _, graphdef, params_a, params_b = models
    sampler = PagedSampler(graphdef, params_a, dataclasses.replace(CONFIG, kv_policy=policy))
    prompt = prompts[1]  # 9 tokens
    sampler.submit(prompt, params=GREEDY)
    assert sampler.step() == [] and sampler.step() == []  # 2 chunks = 8 tokens with version 0
    compiles = sampler.engine.decode_chunk._cache_size()
    sampler.set_params(params_b, version=1)
    (sample,) = _drain(sampler)
    assert sampler.engine.decode_chunk._cache_size() == compiles  # the swap did not recompile
    swap_at = 8
    assert sample.versions == [0] * swap_at + [1] * (MAX_NEW - swap_at)
    assert sample.start_version == 0
    dense = _dense_step_fn(graphdef)
    unswapped = dense(lambda i: params_a, prompt, MAX_NEW)
    head = unswapped[:swap_at]
    fed_before = len(prompt) - 1 + swap_at  # tokens whose K/V the old params made
    keep = dense(lambda i: params_a if i < fed_before else params_b, prompt, MAX_NEW)
    recompute = head + dense(lambda i: params_b, prompt + head, MAX_NEW - swap_at)
    assert keep[:swap_at] == recompute[:swap_at] == head
    assert keep != recompute and keep != unswapped  # the reference can tell them apart
    assert sample.token_ids == (keep if policy == "keep" else recompute)
    from pipelinerl_jax.errors import ConfigError

    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), decoder.arrays(params_b))
    with pytest.raises(ConfigError, match="shapes/dtypes"):
        sampler.set_params(bf16, version=2)


def test_bf16_sampler_tracks_f32(models, prompts, tmp_path):
    """bf16 params, compute and cache: the first greedy token agrees with f32 wherever f32's
    top-2 gap is clear, and its logprob is within bf16 rounding of f32's."""
    hf, graphdef, params, _ = models
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _, graphdef16, params16 = hf_io.load_hf(tmp_path, param_dtype="bfloat16")
    sp = SamplingParams(temperature=0.0, max_new_tokens=2)
    f32 = PagedSampler(graphdef, params, CONFIG).generate(prompts, params=sp)
    bf16 = PagedSampler(graphdef16, params16, CONFIG)
    assert all(p.dtype == jnp.bfloat16 for p in steps.pool_values(bf16.state, bf16.engine.ecfg))
    low = bf16.generate(prompts, params=sp)
    checked = 0
    for p, a, b in zip(prompts, f32, low):
        with torch.no_grad():
            top2 = torch.topk(hf(torch.tensor([p])).logits[0, -1], 2).values
        if top2[0] - top2[1] > 0.1:
            assert a.token_ids[0] == b.token_ids[0]
            assert abs(a.logprobs[0] - b.logprobs[0]) < 0.05
            checked += 1
        assert all(np.isfinite(b.logprobs))
    assert checked >= 3


def test_bf16_decode_chunk_makes_no_f32_copy_of_the_pool(models, prompts, tmp_path):
    """XLA:CPU has no bf16 scatter: written naively, every K/V write upcasts the whole pool
    to f32 and back (attend.set_at). The compiled bf16 decode chunk must hold no f32 array of
    the pool's shape, and no bf16 one either: the pool is stored as its uint16 bits, and a
    per-chunk view of it as bf16 was a copy of the whole pool on entry and on exit."""
    hf, _, _, _ = models
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _, graphdef16, params16 = hf_io.load_hf(tmp_path, param_dtype="bfloat16")
    sampler = PagedSampler(graphdef16, params16, CONFIG)
    engine, state = sampler.engine, sampler.state
    window = engine.ecfg.pages_per_slot
    hlo = (
        engine.decode_chunk.lower(sampler.params, state, np.int32(0), k=2, window=window)
        .compile()
        .as_text()
    )
    pool = ",".join(str(d) for d in state.k_pages.shape)
    assert f"u16[{pool}]" in hlo and f"bf16[{pool}]" not in hlo
    # A fusion, scatter or copy whose result is an f32 pool is a materialised copy (before the
    # fix: 48 of them in this chunk); an f32 convert inside a fused gather reads only the
    # gathered elements and is fine.
    copies = re.findall(r"= f32\[" + pool + r"\]\{[^}]*\} (?:fusion|scatter|copy)\(", hlo)
    assert not copies
    # Nor an f32 copy of the embedding table (it is gathered as bits: forward.decode_params).
    cfg = engine.model_cfg
    table = rf"= f32\[{cfg.vocab_size},{cfg.hidden_size}\]\{{[^}}]*\}} fusion\("
    assert not re.findall(table, hlo)


def test_bad_requests_become_error_samples(models):
    _, graphdef, params, _ = models
    sampler = PagedSampler(graphdef, params, CONFIG)
    sampler.submit([], params=GREEDY)
    sampler.submit([1] * MAX_LEN, params=GREEDY)
    sampler.submit([VOCAB + 5], params=GREEDY)
    sampler.submit([1, 2], params=SamplingParams(top_p=0.0))
    sampler.submit([1, 2], params=GREEDY)
    samples = sorted(_drain(sampler), key=lambda s: s.request_id)
    reasons = [s.finish_reason for s in samples]
    assert reasons[:4] == ["error"] * 4 and reasons[4] == "length"
    assert "empty prompt" in samples[0].error and "max_seq_len" in samples[1].error
    assert "vocabulary" in samples[2].error and "top_p" in samples[3].error
    from pipelinerl_jax.errors import ConfigError

    with pytest.raises(ConfigError, match="num_slots"):
        sampler.submit([1], n=CONFIG.num_slots + 1)

    for bad, match in (
        ({"attention": "flash"}, "attention='flash'"),
        ({"kv_policy": "drop"}, "kv_policy='drop'"),
    ):
        with pytest.raises(ConfigError, match=match):
            PagedSampler(graphdef, params, dataclasses.replace(CONFIG, **bad))


def test_window_buckets():
    from pipelinerl_jax.sampler.steps import pick_window, window_buckets

    assert window_buckets(20) == (1, 2, 3, 4, 6, 8, 12, 16, 20)
    assert window_buckets(3) == (1, 2, 3)
    assert [pick_window(n, 20) for n in (0, 1, 5, 9, 17, 40)] == [1, 1, 6, 12, 20, 20]
