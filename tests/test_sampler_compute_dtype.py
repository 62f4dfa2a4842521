"""sampler.compute_dtype: a bf16 sampler decoding an f32 trainer's params.

The sampler must decode exactly as a sampler of the same model built in bf16 compute would
(same tokens, bit-identical logprobs, one shared engine), take the trainer's f32 versions in
swaps without recompiling, size its weights and KV pool in bf16 (and say so in the memory
estimate), and a run must report the logprob mismatch that bf16 adds.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from pipelinerl_jax import pipeline, presets
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder
from pipelinerl_jax.models.tiny_model import tiny_config
from pipelinerl_jax.pipeline import memory
from pipelinerl_jax.pipeline.compile_watch import CompileWatch
from pipelinerl_jax.pipeline.components import model_config
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.sequence import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
# Tied: the table is the f32 head too, so publishes keep it f32 while the layers go bf16.
MODEL = tiny_config(
    vocab_size=96, hidden_size=64, intermediate_size=128, head_dim=16, tie_word_embeddings=True
)
# One attention window (the whole table): a compile after a swap can only be the swap's.
SAMPLER = SamplerConfig(
    num_slots=4, max_seq_len=32, page_size=8, chunk_steps=4, prefill_chunk=16, min_window_pages=4
)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)


def _prompts(seed, n=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, MODEL.vocab_size, rng.integers(3, 9)).tolist() for _ in range(n)]


def _bf16_twin(seed):
    """The same weights, loaded as a bf16-compute model."""
    return decoder.init(dataclasses.replace(MODEL, compute_dtype="bfloat16"), jax.random.key(seed))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_bf16_sampler_of_f32_params_decodes_as_the_bf16_model(params):
    graphdef, f32_params = decoder.init(MODEL, jax.random.key(1))
    g16, p16 = _bf16_twin(1)
    ours = PagedSampler(
        graphdef, f32_params, dataclasses.replace(SAMPLER, compute_dtype="bfloat16")
    )
    twin = PagedSampler(g16, p16, SAMPLER)
    full = PagedSampler(graphdef, f32_params, SAMPLER)
    prompts = _prompts(2)
    got, want, f32 = (s.generate(prompts, params=params) for s in (ours, twin, full))
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # bit for bit: the same engine on the same view
    assert ours.engine is twin.engine  # one compiled engine for both
    assert {str(x.dtype) for x in jax.tree.leaves(ours.state.k_pages)} != {"float32"}
    # bf16 rounding moves the logprobs (what the trainer's ratio then corrects).
    gaps = [abs(x - y) for a, b in zip(got, f32) for x, y in zip(a.logprobs, b.logprobs)]
    assert 0 < max(gaps) < 0.1


def test_swaps_take_the_trainers_f32_versions_without_recompiling():
    graphdef, v0 = decoder.init(MODEL, jax.random.key(3))
    _, v1 = decoder.init(MODEL, jax.random.key(4))
    ours = PagedSampler(graphdef, v0, dataclasses.replace(SAMPLER, compute_dtype="bfloat16"))
    ours.generate(_prompts(5), params=GREEDY)
    # Counted as backend compilations: the jit's signature cache may add an entry for a
    # placement it has seen compiled (what a run of the module before this test leaves).
    watch = CompileWatch().install()
    try:
        ours.set_params(v1, version=1)
        got = ours.generate(_prompts(6), params=GREEDY)
        compiled, _ = watch.take()
    finally:
        watch.uninstall()
    assert ours.version == 1 and compiled == 0
    g16, p16 = _bf16_twin(4)
    want = PagedSampler(g16, p16, SAMPLER).generate(_prompts(6), params=GREEDY)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]


def test_bad_compute_dtypes_are_one_line_errors():
    with pytest.raises(ConfigError, match="sampler compute_dtype='int8': use one of"):
        SamplerConfig(compute_dtype="int8")
    with pytest.raises(ConfigError, match="sampler cache_dtype='fp8'"):
        SamplerConfig(cache_dtype="fp8")
    proc = subprocess.run(
        [
            sys.executable,
            "launch.py",
            "--config=configs/tiny.py",
            "--config.sampler.compute_dtype=half",
            "--dry_run",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "compute_dtype='half'" in last and "bfloat16" in last


def test_the_memory_estimate_counts_the_samplers_bf16_copy_and_pool():
    base = presets.demo_config()
    base.model.init.update(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=512)
    f32 = presets.run_config(base)
    bf16 = presets.run_config(base, sampler={"compute_dtype": "bfloat16"})
    a = memory.estimate(f32, model_config(f32))
    b = memory.estimate(bf16, model_config(bf16))
    assert b.kv_pool * 2 == a.kv_pool  # the pool follows the sampler's dtype
    assert b.sampler_params < a.sampler_params * 0.65  # 16-bit, but for the f32 head
    assert b.publish < a.publish * 0.6
    assert (b.params, b.optimizer, b.gradients, b.activations) == (
        a.params,
        a.optimizer,
        a.gradients,
        a.activations,
    )  # the trainer's side is unchanged


def test_a_run_with_a_bf16_sampler_trains_f32_and_reports_the_mismatch(tmp_path):
    metrics = {}
    for name, sampler in (("f32", {}), ("bf16", {"compute_dtype": "bfloat16"})):
        cfg = presets.tiny(steps=2, log_every=0, eval_every=0, sampler=sampler)
        pipeline.run(cfg, str(tmp_path / name), echo=lambda *_: None)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        metrics[name] = [json.loads(x) for x in lines if '"kind": "train"' in x][0]
    # Step 0 trains version-0 tokens at version 0: the gap is the sampler's numerics alone.
    assert metrics["f32"]["mismatch/tokens_frac"] == metrics["bf16"]["mismatch/tokens_frac"] == 1
    assert metrics["bf16"]["mismatch/abs_mean"] > 10 * metrics["f32"]["mismatch/abs_mean"]
    assert metrics["bf16"]["mismatch/abs_max"] < 0.5
