"""Train-step throughput on CPU: our jitted step vs torch + transformers doing the same step.

Both sides train BENCH_MODEL (57.9M params) from the same weights on the same batch of
8 sequences x 512 tokens (64 prompt + 448 completion tokens, one sequence per row) with the
paper's objective (tis_reinforce, c = 5, sequence-sum weights) and AdamW with global-norm
clipping. Rows: f32 (f32 params and compute on both sides) and bf16 (f32 params, bf16
compute: torch autocast vs our compute_dtype="bfloat16"). Reports median seconds per step,
tokens/s and our/torch ratio, checks that both sides start from the same loss, and writes
bench/results/train_step.json.

  .venv/bin/python bench/bench_train_step.py           # full size (idle machine, minutes)
  .venv/bin/python bench/bench_train_step.py --quick   # tiny shapes: checks that it runs
  .venv/bin/python bench/bench_train_step.py --model_dir=models/SmolLM2-135M-Instruct

With --model_dir (after `make real-model`): the real model, 16 sequences x 512 tokens (64 prompt
+ 448 completion), f32 and bf16 (f32 params, bf16 compute), per-layer remat on our side and gradient checkpointing on torch's (as
TRL trains by default), 3 alternating rounds with no untimed call between them (a step takes
most of a minute, so the few milliseconds of torch's spinning OpenMP workers do not matter);
Then each side's peak memory: one child process per side and dtype builds that side alone and
makes 2 steps, and reports its peak RSS (the goal: ours <= torch's). Also writes
bench/results/train_step_real.json. `--head_dtype=bfloat16` runs our bf16 rows' LM head on bf16
operands (f32 accumulation), as torch autocast runs its head; the default keeps it f32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pipelinerl_jax.models import config_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from pipelinerl_jax.models import decoder, hf_io  # noqa: E402
from pipelinerl_jax.models.config import REMAT_POLICIES, ModelConfig  # noqa: E402
from pipelinerl_jax.rl.batch import ScoredSample, build_batch  # noqa: E402
from pipelinerl_jax.rl.config import BatchConfig, LossConfig  # noqa: E402
from pipelinerl_jax.train import trainer as tr  # noqa: E402

LR, CLIP_C, GRAD_CLIP, WEIGHT_DECAY = 1e-5, 5.0, 1.0, 0.01


def make_batch(cfg: ModelConfig, num_seq: int, seq_len: int, prompt_len: int):
    rng = np.random.default_rng(0)
    samples = []
    for i in range(num_seq):
        c = seq_len - prompt_len
        samples.append(
            ScoredSample(
                rng.integers(0, cfg.vocab_size, prompt_len).tolist(),
                rng.integers(0, cfg.vocab_size, c).tolist(),
                (-rng.random(c) * 4 - 8).tolist(),
                [0] * c,
                float(rng.random() < 0.5),
                i // 4,
            )
        )
    batch_cfg = BatchConfig(
        seq_len=seq_len, num_rows=num_seq, max_sequences=num_seq, max_sequence_len=seq_len
    )
    return build_batch(samples, batch_cfg)[0]


def jax_trainer(cfg: ModelConfig, params, batch, token_chunk: int, head_dtype: str = "float32"):
    """(Trainer, its state, the batch on its mesh) of our side's step."""
    tcfg = tr.TrainerConfig(
        learning_rate=LR,
        lr_schedule="constant",
        warmup_steps=0,
        weight_decay=WEIGHT_DECAY,
        grad_clip_norm=GRAD_CLIP,
        loss=LossConfig(tis_clip=CLIP_C, token_chunk=token_chunk, head_dtype=head_dtype),
    )
    graphdef, abstract_params = decoder.abstract_init(cfg)
    trainer = tr.Trainer(tcfg, graphdef, abstract_params, tr.trainer_mesh(jax.devices()[:1]))
    return trainer, trainer.init_state(params), trainer.put_batch(batch)


def jax_step(cfg: ModelConfig, params, batch, token_chunk: int, head_dtype: str = "float32"):
    trainer, state, dev_batch = jax_trainer(cfg, params, batch, token_chunk, head_dtype)
    box = {"state": state}

    def step():
        box["state"], metrics = trainer.train_step(box["state"], dev_batch)
        return float(metrics["loss"])

    return step


def torch_step(cfg: ModelConfig, params, batch, autocast: bool, checkpointing: bool = False):
    import torch
    import transformers

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        **{
            k: v
            for k, v in config_json.to_hf(cfg).items()
            if k not in ("architectures", "torch_dtype")
        }
    )
    model = transformers.LlamaForCausalLM(hf_cfg).float()
    state = {name: torch.from_numpy(np.array(a)) for name, a in hf_io.hf_tensors(cfg, params)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = lambda m: cfg.tie_word_embeddings and m == "lm_head.weight"  # shares embed's storage
    assert not unexpected and all("rotary" in m or tied(m) for m in missing), (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=1e-8)
    t = lambda x, dt=None: (
        torch.from_numpy(np.asarray(x)) if dt is None else torch.from_numpy(np.asarray(x)).to(dt)
    )
    tokens, targets = t(batch.tokens).long(), t(batch.targets).long()
    mu, adv, w = t(batch.behaviour_logprobs), t(batch.advantages), t(batch.token_weights)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=tokens).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        lp = logp.gather(-1, targets[..., None])[..., 0]
        coef = torch.clamp(torch.exp(lp - mu), max=CLIP_C).detach()
        loss = -(w * coef * adv * lp).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        return float(loss.detach())

    return step


def main(argv=None) -> dict:
    parser = common.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per side (f32)")
    parser.add_argument(
        "--repeats-bf16",
        type=int,
        default=3,
        help="timed steps per side for bf16 (torch autocast is slow on CPUs without native bf16)",
    )
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--no-peer-dtypes",
        default="",
        help="dtypes whose torch step is not timed (recorded with the reason): "
        "torch's bf16 autocast backward takes most of an hour per step on "
        "CPUs without AMX/avx512_bf16",
    )
    parser.add_argument("--token-chunk", type=int, default=1024)
    parser.add_argument(
        "--model_dir",
        default=None,
        help="a Hugging Face directory: time that model (16 x 512, remat "
        "vs gradient checkpointing, --dtypes) instead of the bench model",
    )
    parser.add_argument(
        "--head_dtype",
        default="float32",
        help="our LM head's matmul operands in the bf16 rows (float32 or bfloat16)",
    )
    parser.add_argument(
        "--remat_policy",
        default="matmuls",
        choices=tuple(REMAT_POLICIES),
        help="what our rematerialised layers keep with --model_dir (model.remat_policy)",
    )
    parser.add_argument(
        "--peak_of",
        choices=("ours", "torch"),
        default=None,
        help="(internal) build one side for --model_dir and --dtypes, make 2 steps, print its "
        "peak RSS as JSON",
    )
    parser.add_argument(
        "--no_peaks", action="store_true", help="skip the per-side peak-memory child runs"
    )
    args = parser.parse_args(argv)
    if args.peak_of:
        return peak_of(args)
    if args.model_dir:
        return real_model(args)
    import torch

    torch.set_num_threads(os.cpu_count())
    load = common.warn_if_busy()
    num_seq, seq_len, prompt_len = (2, 64, 16) if args.quick else (8, 512, 64)
    rows = []
    for dtype in args.dtypes.split(","):
        repeats = 2 if args.quick else (args.repeats if dtype == "float32" else args.repeats_bf16)
        cfg = common.bench_model_config(args.quick, dtype)
        _, params = decoder.init(cfg, jax.random.key(0))
        batch = make_batch(cfg, num_seq, seq_len, prompt_len)
        ours = jax_step(cfg, params, batch, args.token_chunk)
        t0 = time.perf_counter()
        first_ours = ours()  # compiles; also the warm-up step
        compile_s = time.perf_counter() - t0
        tokens = num_seq * seq_len
        row = dict(dtype=dtype, first_loss_ours=first_ours, compile_s=compile_s)
        steps = {"ours": ours}
        if dtype in args.no_peer_dtypes.split(","):
            row["torch_not_timed"] = (
                "--no-peer-dtypes: torch's CPU step in this dtype is "
                "too slow to time on this machine"
            )
        else:
            steps["torch"] = torch_step(cfg, params, batch, dtype == "bfloat16")
            row["first_loss_torch"] = steps["torch"]()  # warm-up step
        medians = common.alternating_medians(steps, repeats=repeats, warmup=1)
        ours_s = medians["ours"][0]
        row.update(ours_s=ours_s, ours_tok_s=tokens / ours_s)
        if "torch" in medians:
            theirs_s = medians["torch"][0]
            row.update(torch_s=theirs_s, torch_tok_s=tokens / theirs_s, ratio=theirs_s / ours_s)
        rows.append(row)
    common.print_table(
        rows,
        [
            "dtype",
            "ours_tok_s",
            "torch_tok_s",
            "ratio",
            "ours_s",
            "torch_s",
            "first_loss_ours",
            "first_loss_torch",
            "compile_s",
        ],
    )
    payload = dict(
        benchmark="train_step",
        quick=args.quick,
        load=load,
        rows=rows,
        config=dict(
            model=common.BENCH_MODEL if not args.quick else "quick",
            sequences=num_seq,
            seq_len=seq_len,
            prompt_len=prompt_len,
            objective="tis_reinforce",
            optimizer="adamw",
            token_chunk=args.token_chunk,
            repeats=dict(float32=args.repeats, bfloat16=args.repeats_bf16),
            jax=jax.__version__,
            torch=torch.__version__,
        ),
    )
    common.write_result("train_step_quick" if args.quick else "train_step", payload)
    return payload


REAL_SHAPE = dict(num_seq=16, seq_len=512, prompt_len=64)


def _real_inputs(args, dtype: str):
    """(cfg, f32 params, batch) of the real model with `dtype` compute, loaded once per dtype."""
    cfg, _, params = hf_io.load_hf(
        args.model_dir,
        param_dtype="float32",
        compute_dtype=dtype,
        remat=True,
        remat_policy=args.remat_policy,
    )
    batch = make_batch(cfg, REAL_SHAPE["num_seq"], REAL_SHAPE["seq_len"], REAL_SHAPE["prompt_len"])
    return cfg, params, batch


def _real_side(args, dtype: str, side: str, inputs):
    """One side's step function for the real model in `dtype` (f32 params, `dtype` compute)."""
    cfg, params, batch = inputs
    if side == "ours":
        head = args.head_dtype if dtype == "bfloat16" else "float32"
        return jax_step(cfg, params, batch, args.token_chunk, head)
    return torch_step(cfg, params, batch, autocast=dtype == "bfloat16", checkpointing=True)


def peak_of(args) -> dict:
    """Child process: one side alone, 2 steps, its peak RSS on stdout (the last line); the
    peak is this process's own (host_memory.peak_rss_bytes), not the parent's that spawned it."""
    import torch

    from pipelinerl_jax.pipeline import host_memory

    torch.set_num_threads(os.cpu_count())
    step = _real_side(args, args.dtypes, args.peak_of, _real_inputs(args, args.dtypes))
    losses = [step(), step()]
    out = dict(
        side=args.peak_of, dtype=args.dtypes, peak_rss_gib=host_memory.peak_rss_bytes() / 2**30
    )
    print(json.dumps(dict(out, losses=losses)), flush=True)
    return out


def measure_peaks(args, dtype: str) -> dict:
    """{side: peak RSS GiB} from one child process per side (peak RSS is per process)."""
    peaks = {}
    for side in ("ours", "torch"):
        cmd = [sys.executable, __file__, f"--model_dir={args.model_dir}", f"--dtypes={dtype}"]
        cmd += [f"--peak_of={side}", f"--head_dtype={args.head_dtype}"]
        cmd += [f"--token-chunk={args.token_chunk}", f"--remat_policy={args.remat_policy}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{side} {dtype} peak run failed:\n{proc.stderr[-2000:]}")
        peaks[side] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_gib"]
    return peaks


def real_model(args) -> dict:
    """The real model's step, per dtype: ours (remat) vs torch + transformers (gradient
    checkpointing). bf16: f32 params (the master weights) with bf16 compute on both sides,
    ours through compute_dtype, torch through autocast."""
    import torch

    torch.set_num_threads(os.cpu_count())
    load = common.warn_if_busy()
    num_seq, seq_len, prompt_len, repeats = *REAL_SHAPE.values(), 3
    tokens = num_seq * seq_len
    rows = []
    for dtype in args.dtypes.split(","):
        inputs = _real_inputs(args, dtype)
        ours = _real_side(args, dtype, "ours", inputs)
        t0 = time.perf_counter()
        first_ours = ours()  # compiles
        compile_s = time.perf_counter() - t0
        row = dict(dtype=dtype, first_loss_ours=first_ours, compile_s=compile_s)
        if dtype == "bfloat16":
            row["head_dtype"] = args.head_dtype
        steps = {"ours": ours}
        if dtype in args.no_peer_dtypes.split(","):
            row["torch_not_timed"] = "--no-peer-dtypes"
        else:
            steps["torch"] = _real_side(args, dtype, "torch", inputs)
            row["first_loss_torch"] = steps["torch"]()
        medians = common.alternating_medians(steps, repeats=repeats, warmup=0)
        ours_s = medians["ours"][0]
        row.update(ours_s=ours_s, ours_tok_s=tokens / ours_s, ours_times=medians["ours"][1])
        if "torch" in medians:
            torch_s = medians["torch"][0]
            row.update(
                torch_s=torch_s,
                torch_tok_s=tokens / torch_s,
                ratio=torch_s / ours_s,
                torch_times=medians["torch"][1],
            )
        del steps, ours, inputs
        if not args.no_peaks:
            peaks = measure_peaks(args, dtype)
            row.update(ours_peak_gib=peaks["ours"], torch_peak_gib=peaks["torch"])
        rows.append(row)
        print(row, flush=True)
    common.print_table(
        rows,
        [
            "dtype",
            "ours_tok_s",
            "torch_tok_s",
            "ratio",
            "ours_s",
            "torch_s",
            "ours_peak_gib",
            "torch_peak_gib",
            "first_loss_ours",
            "first_loss_torch",
            "compile_s",
        ],
    )
    payload = dict(
        benchmark="train_step_real",
        load=load,
        rows=rows,
        config=dict(
            model=str(args.model_dir),
            sequences=num_seq,
            seq_len=seq_len,
            prompt_len=prompt_len,
            objective="tis_reinforce",
            optimizer="adamw",
            remat="ours: per layer; torch: gradient checkpointing",
            remat_policy=args.remat_policy,
            bf16="f32 params, bf16 compute (ours compute_dtype, torch autocast)",
            peak_rss="one child process per side and dtype, 2 steps each",
            token_chunk=args.token_chunk,
            repeats=repeats,
            jax=jax.__version__,
            torch=torch.__version__,
        ),
    )
    common.write_result("train_step_real", payload)
    return payload


if __name__ == "__main__":
    main()
