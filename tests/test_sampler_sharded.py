"""The sampler on a multi-device mesh still equals transformers' greedy generation.

Data parallel: slots over a 2-device mesh, with a page pool so small that sequences are
preempted and resumed, two attempts per prompt sharing its prefill. Tensor parallel: params,
KV pool and attention split over a tp axis (alone and with a data axis), all three decode
attention paths (gather, paged, staged), a weight swap that must not recompile, and sampled tokens equal to a 1-device run.

Runs in a subprocess because simulated CPU devices must be configured before JAX starts.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.tiny_models import hf_greedy, save_hf_llama
from tests.xla_env import child_env

VOCAB, MAX_NEW = 96, 12

CHILD = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from jax.sharding import Mesh
    from pipelinerl_jax.errors import ConfigError
    from pipelinerl_jax.models import hf_io
    from pipelinerl_jax.sampler.sampler import PagedSampler
    from pipelinerl_jax.sampler.config import SamplerConfig
    from pipelinerl_jax.sampler.sequence import SamplingParams
    ckpt, prompts_path, data, tp, attention = sys.argv[1:6]
    data, tp = int(data), int(tp)
    prompts = json.load(open(prompts_path))
    assert len(jax.devices()) == 8
    grid = np.asarray(jax.devices()[:data * tp]).reshape(data, tp)
    mesh = Mesh(grid, ("data", "tp"))
    _, graphdef, params = hf_io.load_hf(ckpt)
    # Per data shard 3 pages of 16 tokens: 2 usable pages (32 tokens) for its 2 slots, while
    # a prompt of 17 + 12 new tokens needs both alone.
    config = SamplerConfig(num_slots=2 * data, max_seq_len=48, page_size=16,
                           num_pages=3 * data, chunk_steps=4, prefill_chunk=16,
                           max_prefill_rows=2, min_window_pages=3, attention=attention)
    sampler = PagedSampler(graphdef, params, config, mesh=mesh)
    pages_spec = tuple(sampler.state.k_pages.sharding.spec)     # [L, P, K, S, D]
    q_spec = tuple(sampler.params["layers"][0]["q_proj"].sharding.spec)
    # n=2: the attempts of a prompt share its full pages and copy its partial last page.
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    samples = sampler.generate(prompts, n=2, params=greedy)
    out = {"tokens": [s.token_ids for s in samples], "logprobs": [s.logprobs for s in samples],
           "preemptions": sampler.stats["preemptions"], "pages_spec": pages_spec,
           "q_spec": q_spec}
    if tp > 1:
        # A swap to prepared params (what the pipeline's publisher stages) must not recompile.
        compiles = sampler.engine.decode_chunk._cache_size()
        sampler.set_params(sampler.prepare(params), 1, prepared=True)
        again = sampler.generate(prompts[:2], params=greedy)
        out["swap_recompiled"] = sampler.engine.decode_chunk._cache_size() != compiles
        out["swap_versions"] = sorted({v for s in again for v in s.versions})
        out["swap_tokens"] = [s.token_ids for s in again]
        # Temperature sampling (seeded per request, so both samplers draw the same uniforms):
        # the tp group draws one token per row, as one device does.
        hot = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=11)
        one = PagedSampler(graphdef, params, config, mesh=Mesh(grid[:, :1], ("data", "tp")))
        out["sampled_tp"] = [s.token_ids for s in sampler.generate(prompts, params=hot)]
        out["sampled_one"] = [s.token_ids for s in one.generate(prompts, params=hot)]
        try:
            PagedSampler(graphdef, params, config, mesh=Mesh(np.asarray(jax.devices()[:4])
                                                        .reshape(1, 4), ("data", "tp")))
            out["bad_tp_error"] = None
        except ConfigError as e:
            out["bad_tp_error"] = str(e)
    print(json.dumps(out))
""".replace("MAX_NEW_TOKENS", str(MAX_NEW))
)


@pytest.mark.parametrize("data,tp,attention", [(2, 1, "gather"), (1, 2, "paged"), (2, 2, "staged")])
def test_sharded_sampler_matches_transformers(tmp_path, data, tp, attention):
    model = save_hf_llama(tmp_path / "ckpt", 3, VOCAB)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (17, 5, 11, 2, 14, 9)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    env = child_env(8, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(tmp_path / "ckpt"),
            str(tmp_path / "prompts.json"),
            str(data),
            str(tp),
            attention,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["preemptions"] > 0, "the tiny pool should have forced preemption"
    assert got["pages_spec"][1] == "data"
    if tp > 1:
        # Split by heads: [H * D, E] output-major in the CPU strategies' feature-major layout,
        # [E, H, D] as stored in the paged (GPU) strategy's token-major one.
        want_q = [None, "tp"] if attention == "paged" else ["tp"]
        assert got["pages_spec"][2] == "tp" and got["q_spec"] == want_q
    assert len(got["tokens"]) == 2 * len(prompts)
    for i, prompt in enumerate(prompts):
        want, ref, _ = hf_greedy(model, prompt, MAX_NEW)
        for attempt in range(2):
            assert got["tokens"][2 * i + attempt] == want
            np.testing.assert_allclose(got["logprobs"][2 * i + attempt], ref, rtol=1e-4, atol=1e-5)
    if tp > 1:
        assert not got["swap_recompiled"]
        assert got["swap_versions"] == [1]
        assert got["swap_tokens"] == [got["tokens"][0], got["tokens"][2]]
        assert got["sampled_tp"] == got["sampled_one"]
        assert got["sampled_tp"] != [t[:MAX_NEW] for t in got["tokens"][::2]]  # not greedy
        assert "num_kv_heads=2" in got["bad_tp_error"]
