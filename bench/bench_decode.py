"""Decode throughput of the pipelinerl_jax sampler against transformers `generate`, same weights.

    .venv/bin/python bench/bench_decode.py            # the timed run (machine must be idle)
    .venv/bin/python bench/bench_decode.py --quick    # a small check that everything runs

Fixed config (bench/common.BENCH_MODEL, 57.9M params, untied head), prompts of 32 random
tokens, 128 forced new tokens (no EOS), greedy, batch 1 / 8 / 32 / 64, and temperature-1
sampling (no top-k / top-p, as RL samples) at batch 8 / 64. Tokens/s = generated
tokens / wall time of the whole generate call (prefill included) for both engines; medians
over repeats timed in alternating rounds (common.alternating_medians says why) and ratios.
Also: the same rates as a fraction of this machine's f32 large-matmul rate (2 * matmul
params FLOPs per token), a bf16 row against transformers bf16, what XLA does
with bf16 matmuls under several CPU flags (subprocesses, since XLA_FLAGS is read at start-up),
and the cost of an in-flight param swap. Writes bench/results/decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipelinerl_jax.models import param_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402

PROMPT_LEN = 32

FLAG_SETS = {
    "default": "",
    "ynn_off": "--xla_cpu_experimental_ynn_fusion_type=",
    "ynn_dots_off": "--xla_cpu_experimental_ynn_fusion_type=-individual_dot",
    "xnnpack_off": "--xla_cpu_use_xnnpack=false",
    "onednn": "--xla_cpu_use_onednn=true",
    "onednn_custom_call": "--xla_cpu_experimental_onednn_custom_call=true",
}

MATMUL_PROBE = r"""
import json, time, numpy as np, jax, jax.numpy as jnp
def rate(m, k, n, dtype, reps):
    a = jnp.asarray(np.random.default_rng(0).standard_normal((m, k)), dtype)
    b = jnp.asarray(np.random.default_rng(1).standard_normal((k, n)), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    f(a, b).block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(a, b).block_until_ready(); ts.append(time.perf_counter() - t)
    return 2 * m * k * n / float(np.median(ts)) / 1e9
reps, n = %d, %d
out = {}
for dt in ("float32", "bfloat16"):
    out[dt + "_%%d" %% n] = rate(n, n, n, dt, reps)
    out[dt + "_head_b64"] = rate(64, 512, 32000, dt, reps)
print(json.dumps(out))
"""


def make_checkpoint(path: Path):
    """Random BENCH_MODEL weights saved by transformers; both engines load this directory."""
    import torch
    import transformers

    m = common.BENCH_MODEL
    config = transformers.LlamaConfig(
        vocab_size=m["vocab_size"],
        hidden_size=m["hidden_size"],
        intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_heads"],
        num_key_value_heads=m["num_kv_heads"],
        head_dim=m["head_dim"],
        tie_word_embeddings=m["tie_word_embeddings"],
        max_position_embeddings=2048,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def hf_generate_fn(
    path: Path, dtype: str, prompts: np.ndarray, new_tokens: int, temperature: float = 0.0
):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    # Plain temperature sampling, as RL samples: transformers' default top_k=50 switched off.
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        if temperature > 0
        else dict(do_sample=False)
    )

    def run():
        with torch.no_grad():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                **sampling,
            )

    return run


def our_sampler(
    path: Path,
    dtype: str,
    batch: int,
    new_tokens: int,
    chunk_steps: int,
    prompt_len: int = PROMPT_LEN,
    head_dtype: str = "float32",
):
    from pipelinerl_jax.models import hf_io
    from pipelinerl_jax.sampler.config import SamplerConfig
    from pipelinerl_jax.sampler.sampler import PagedSampler

    _, graphdef, params = hf_io.load_hf(path, param_dtype=dtype)
    page = 16
    max_len = -(-(prompt_len + new_tokens) // page) * page
    config = SamplerConfig(
        num_slots=batch,
        max_seq_len=max_len,
        page_size=page,
        chunk_steps=chunk_steps,
        max_prefill_rows=min(batch, 64),
        prefill_chunk=max(page, min(512, max_len)),
        head_dtype=head_dtype,
    )
    return PagedSampler(graphdef, params, config), params


def bench_pair(
    path,
    dtype,
    batch,
    new_tokens,
    repeats,
    chunk_steps,
    check_parity,
    temperature: float = 0.0,
    *,
    prompt_len: int = PROMPT_LEN,
    vocab_size: int = common.BENCH_MODEL["vocab_size"],
    head_dtype: str = "float32",
):
    """One row: ours vs transformers generate, greedy (temperature 0) or plain temperature
    sampling (no top-k / top-p: how RL samples), every row forced to `new_tokens` tokens
    (no EOS on either side), from random prompts of `prompt_len` tokens."""
    from pipelinerl_jax.sampler.sequence import SamplingParams

    prompts = np.random.default_rng(batch).integers(0, vocab_size, (batch, prompt_len))
    sampler, params = our_sampler(
        path, dtype, batch, new_tokens, chunk_steps, prompt_len, head_dtype=head_dtype
    )
    how = SamplingParams(temperature=temperature, max_new_tokens=new_tokens)
    ours_out, hf_out = [], []
    hf_fn = hf_generate_fn(path, dtype, prompts, new_tokens, temperature)
    medians = common.alternating_medians(
        {
            "ours": lambda: ours_out.append(sampler.generate(list(prompts), params=how)),
            "hf": lambda: hf_out.append(hf_fn()),
        },
        repeats=repeats,
        warmup=1,
    )
    ours_s, hf_s = medians["ours"][0], medians["hf"][0]
    ours_tokens = sum(len(s.token_ids) for s in ours_out[-1])
    if ours_tokens != batch * new_tokens:
        raise SystemExit(
            f"ours generated {ours_tokens} tokens, not {batch * new_tokens}: the "
            "bench model must not stop early"
        )
    row = {
        "batch": batch,
        "dtype": dtype,
        "temperature": temperature,
        "ours_tok_s": batch * new_tokens / ours_s,
        "hf_tok_s": batch * new_tokens / hf_s,
    }
    row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
    if check_parity:
        ours_tokens = [s.token_ids for s in ours_out[-1]]
        hf_tokens = hf_out[-1][:, prompt_len:].tolist()
        row["same_tokens_frac"] = float(np.mean([a == b for a, b in zip(ours_tokens, hf_tokens)]))
    return row, sampler, params


def bench_swap(sampler, params, chunk_steps: int, repeats: int) -> dict:
    """Staged params -> first chunk with them, against the same chunk without a swap.

    The same requests run in passes without swaps and passes that stage new params before
    every chunk after the first (alternating between two versions), `repeats` passes of each,
    interleaved, after one untimed swapping pass; chunk i of a swapping pass is compared with
    chunk i of a plain pass (same lengths and attention window), and the extra cost is the
    median over chunks of the difference of their median times. `params` are model params (stacked, as the trainer
    publishes them); as in the pipeline, the conversion to the engine's per-layer view
    (`Sampler.prepare`) happens before staging (the publisher runs it in the trainer thread),
    and its time is reported separately.
    """
    import jax

    from pipelinerl_jax.sampler.sequence import SamplingParams

    batch = sampler.config.num_slots
    t = time.perf_counter()
    versions = [
        jax.block_until_ready(sampler.prepare(jax.tree.map(lambda x: x * f, params)))
        for f in (1.001, 0.999)
    ]
    prepare_s = (time.perf_counter() - t) / len(versions)
    prompts = np.random.default_rng(1).integers(0, 1000, (batch, PROMPT_LEN))
    budget = sampler.config.max_seq_len - PROMPT_LEN

    def one_pass(swap: bool) -> list[float]:
        for p in prompts:
            sampler.submit(p, params=SamplingParams(temperature=0.0, max_new_tokens=budget))
        times, index = [], 0
        while sampler.has_work():
            start = time.perf_counter()
            if swap and index > 0:  # chunk 0 also admits and prefills
                sampler.set_params(versions[index % 2], version=sampler.version + 1, prepared=True)
            sampler.step()
            times.append(time.perf_counter() - start)
            index += 1
        return times

    one_pass(swap=True)  # warm-up: compiles every window the passes use
    compiles = sampler.engine.decode_chunk._cache_size()
    plain, swapped = [], []
    for _ in range(max(1, repeats)):
        plain.append(one_pass(swap=False))
        swapped.append(one_pass(swap=True))
    chunks = min(map(len, plain + swapped))
    if chunks < 2:
        raise SystemExit(
            "the swap benchmark needs 2+ decode chunks per pass: raise --new_tokens "
            "or lower --chunk_steps"
        )
    plain_i = [float(np.median([p[i] for p in plain])) for i in range(1, chunks)]
    swap_i = [float(np.median([s[i] for s in swapped])) for i in range(1, chunks)]
    step_s = float(np.median(plain_i)) / chunk_steps
    extra_s = float(np.median(np.subtract(swap_i, plain_i)))
    return {
        "batch": batch,
        "chunk_steps": chunk_steps,
        "chunk_s": float(np.median(plain_i)),
        "prepare_s_off_the_sampler_thread": prepare_s,
        "staged_to_first_token_visible_s": float(np.median(swap_i)),
        "extra_cost_in_decode_steps": extra_s / step_s,
        "swaps_timed": (chunks - 1) * max(1, repeats),
        "recompiled": sampler.engine.decode_chunk._cache_size() != compiles,
    }


def flags_study(quick: bool) -> dict:
    out = {}
    names = ["default", "onednn"] if quick else list(FLAG_SETS)
    for name in names:
        flags = FLAG_SETS[name]
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        probe = MATMUL_PROBE % ((2, 512) if quick else (5, 2048))
        proc = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600
        )
        out[name] = (
            json.loads(proc.stdout.strip().splitlines()[-1])
            if proc.returncode == 0
            else {"error": proc.stderr.strip().splitlines()[-1][:200]}
        )
    import torch

    torch.set_num_threads(os.cpu_count())
    n = 512 if quick else 2048
    for dt in ("float32", "bfloat16"):
        a = torch.randn(n, n, dtype=getattr(torch, dt))
        a @ a
        t = time.perf_counter()
        for _ in range(3):
            a @ a
        out.setdefault("torch", {})[f"{dt}_{n}"] = 3 * 2 * n**3 / (time.perf_counter() - t) / 1e9
    return out


def main(argv=None):
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (batches 1,8; 16 tokens; 1 repeat; chunks of 4): checks that it runs",
    )
    # None: not given (--quick sets its own sizes and refuses these).
    ap.add_argument("--batches", default=None, help="comma-separated (default 1,8,32,64)")
    ap.add_argument("--new_tokens", type=int, default=None, help="default 128")
    ap.add_argument("--repeats", type=int, default=None, help="default 3")
    ap.add_argument("--chunk_steps", type=int, default=None, help="default 16")
    args = ap.parse_args(argv)
    sizes = ("batches", "new_tokens", "repeats", "chunk_steps")
    given = [f"--{k}" for k in sizes if getattr(args, k) is not None]
    if args.quick and given:
        common.refuse(f"--quick sets its own sizes: leave out {', '.join(given)}")
    defaults = dict(batches="1,8,32,64", new_tokens=128, repeats=3, chunk_steps=16)
    args = argparse.Namespace(
        **{**vars(args), **{k: v for k, v in defaults.items() if getattr(args, k) is None}}
    )
    batches = common.number_list(args.batches, "--batches", minimum=1)
    new_tokens = common.at_least(args.new_tokens, "--new_tokens")
    repeats = common.at_least(args.repeats, "--repeats")
    chunk = common.at_least(args.chunk_steps, "--chunk_steps")
    if chunk >= new_tokens:
        common.refuse(
            f"--chunk_steps={chunk} with --new_tokens={new_tokens}: the param-swap benchmark "
            "needs 2+ decode chunks a pass; give --chunk_steps below --new_tokens"
        )
    if args.quick:
        batches, new_tokens, repeats, chunk = [1, 8], 16, 1, 4

    load = common.warn_if_busy()
    flop_per_token = 2 * param_counts.matmul_params_per_token(common.bench_model_config())
    gflops = common.f32_matmul_gflops(n=1024 if args.quick else 2048)
    rows, swap = [], None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench_model"
        make_checkpoint(path)
        for batch in batches:
            row, sampler, params = bench_pair(
                path, "float32", batch, new_tokens, repeats, chunk, check_parity=batch <= 8
            )
            row["frac_f32_matmul_peak"] = row["ours_tok_s"] * flop_per_token / (gflops * 1e9)
            row["hf_frac_f32_matmul_peak"] = row["hf_tok_s"] * flop_per_token / (gflops * 1e9)
            rows.append(row)
            print(row, flush=True)
            if batch == (8 if 8 in batches else batches[0]):
                swap = bench_swap(sampler, params, chunk, repeats)
                print("swap", swap, flush=True)
        for batch in [8] if args.quick else [8, 64]:
            row, _, _ = bench_pair(path, "bfloat16", batch, new_tokens, repeats, chunk, False)
            rows.append(row)
            print(row, flush=True)
        for batch in [8] if args.quick else [8, 64]:
            row, _, _ = bench_pair(
                path, "float32", batch, new_tokens, repeats, chunk, False, temperature=1.0
            )
            rows.append(row)
            print(row, flush=True)
    flags = flags_study(args.quick)
    payload = {
        "config": {
            **common.BENCH_MODEL,
            "prompt_len": PROMPT_LEN,
            "new_tokens": new_tokens,
            "greedy": True,
            "chunk_steps": chunk,
            "quick": args.quick,
        },
        "load_before": load,
        "load_after": common.load_average(),
        "cpu": common.cpu_features(),
        "f32_matmul_gflops": gflops,
        "flop_per_token": flop_per_token,
        "rows": rows,
        "param_swap": swap,
        "xla_bf16_flags": flags,
    }
    common.print_table(
        rows,
        [
            "batch",
            "dtype",
            "ours_tok_s",
            "hf_tok_s",
            "ratio",
            "frac_f32_matmul_peak",
            "hf_frac_f32_matmul_peak",
            "same_tokens_frac",
        ],
    )
    print(json.dumps(flags, indent=1))
    common.write_result("decode_quick" if args.quick else "decode", payload)


if __name__ == "__main__":
    sys.exit(main())
