"""Slots data-parallel over a 2-device sampler mesh, with a page pool so small that sequences
are preempted and resumed, two attempts per prompt sharing its prefill: every attempt still
equals transformers' greedy generation.

Runs in a subprocess because simulated CPU devices must be configured before JAX starts.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import torch
import transformers

VOCAB, MAX_NEW = 96, 12

CHILD = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jax.sharding import Mesh
    from pipelinerl_jax.models import hf_io
    from pipelinerl_jax.sampler.sampler import Sampler, SamplerConfig
    from pipelinerl_jax.sampler.scheduler import SamplingParams
    ckpt, prompts_path = sys.argv[1], sys.argv[2]
    prompts = json.load(open(prompts_path))
    assert len(jax.devices()) == 8
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
    _, graphdef, params = hf_io.load_hf(ckpt)
    # 2 shards x 3 pages of 16 tokens: 2 usable pages (32 tokens) per shard for its 2
    # slots, while a prompt of 17 + 12 new tokens needs both alone.
    config = SamplerConfig(num_slots=4, max_seq_len=48, page_size=16, num_pages=6,
                           chunk_steps=4, prefill_chunk=16, max_prefill_rows=2,
                           min_window_pages=3, attention="gather")
    sampler = Sampler(graphdef, params, config, mesh=mesh)
    assert sampler.state.k_pages.sharding.spec[1] == "data"      # [L, P, S, K, D]
    # n=2: the attempts of a prompt share its full pages and copy its partial last page.
    samples = sampler.generate(prompts, n=2, params=SamplingParams(temperature=0.0,
                                                                   max_new_tokens=%d))
    print(json.dumps({"tokens": [s.token_ids for s in samples],
                      "logprobs": [s.logprobs for s in samples],
                      "preemptions": sampler.stats["preemptions"]}))
""" % MAX_NEW)


def test_sharded_slots_with_preemption_match_transformers(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, initializer_range=0.15, rms_norm_eps=1e-5)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (17, 5, 11, 2, 14, 9)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ckpt"),
                           str(tmp_path / "prompts.json")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["preemptions"] > 0, "the tiny pool should have forced preemption"
    assert len(got["tokens"]) == 2 * len(prompts)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, return_dict_in_generate=True,
                                 output_logits=True)
        want = out.sequences[0, len(prompt):].tolist()
        ref = torch.log_softmax(torch.stack(out.logits)[:, 0], -1)[torch.arange(MAX_NEW), want]
        for attempt in range(2):
            assert got["tokens"][2 * i + attempt] == want
            np.testing.assert_allclose(got["logprobs"][2 * i + attempt], ref.numpy(),
                                       rtol=1e-4, atol=1e-5)
