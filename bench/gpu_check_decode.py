"""bench/gpu_check.py's `decode` stage: our sampler against transformers `generate`.

Both engines run the same random weights (ours, copied into the transformers model) in bf16,
on the same prompts, making exactly `new_tokens` tokens by plain sampling, timed in alternating
rounds; each row also records the roofline's prediction. The rehearsal runs transformers on
torch CPU in f32 (same code path). torch, transformers and JAX are imported inside the
functions: `gpu_check.py --help` must work without them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from bench.gpu_check_harness import Stage, fmt, free_memory
from bench.gpu_check_predict import model_config, predict_decode
from pipelinerl_jax.models import config_json, param_counts

if TYPE_CHECKING:
    from bench.gpu_check import Sizes


def _torch_device(args) -> tuple[str | None, str | None]:
    """(device for transformers, None) or (None, why it is not run)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return None, f"transformers not run: torch does not import ({type(e).__name__}: {e})"
    if args.cpu_rehearsal:
        return "cpu", None  # the rehearsal runs transformers on torch CPU: same code path
    if not torch.cuda.is_available():
        return None, "transformers not run: torch sees no CUDA device"
    return "cuda", None


def _hf_model(cfg, params, device: str):
    """transformers' model of cfg on `device`, holding our params (the same weights): bf16 on
    the GPU; f32 on torch CPU (the rehearsal), where bf16 sampling ran 6x slower than f32."""
    import numpy as np
    import torch
    import transformers

    from pipelinerl_jax.models import hf_io

    hf = config_json.to_hf(cfg)
    model_type = hf.pop("model_type")
    hf_cfg = transformers.AutoConfig.for_model(model_type, **hf)
    try:
        with torch.device(device):  # random init straight on the GPU: it is overwritten below
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    except Exception:  # noqa: BLE001 - a transformers that refuses the device context
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = model.to(device=device, dtype=dtype).eval()
    state = model.state_dict()
    # One tensor at a time (Qwen2.5-1.5B's f32 copy would be 6 GB at once); via f32 because
    # torch does not read numpy's bf16, and bf16 -> f32 -> bf16 is exact.
    loaded = set()
    for name, array in hf_io.hf_tensors(cfg, params):
        state[name].copy_(torch.from_numpy(np.asarray(array, np.float32)))
        loaded.add(name)
    left = [k for k in state if k not in loaded and "rotary" not in k]
    if cfg.tie_word_embeddings:
        model.tie_weights()
        left = [k for k in left if k != "lm_head.weight"]
    if left:
        raise RuntimeError(f"transformers model tensors not set from ours: {left[:5]}")
    return model


def _hf_generate_fn(model, prompts, new_tokens: int, temperature: float, device: str):
    """A blocking generate call of `new_tokens` tokens exactly (no EOS), plain sampling."""
    import torch

    ids = torch.tensor(prompts, device=device)
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        if temperature > 0
        else dict(do_sample=False)
    )

    def run():
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                **sampling,
            )
        if device == "cuda":
            torch.cuda.synchronize()  # generate returns before the GPU is done
        return out

    return run


def _our_sampler(graphdef, params, batch: int, sizes: Sizes):
    """Our PagedSampler for `batch` prompts: bf16 cache and head, attention "paged" (the Triton
    kernel on GPU, its jnp reference on CPU), every window one compile."""
    from pipelinerl_jax.sampler.config import SamplerConfig
    from pipelinerl_jax.sampler.sampler import PagedSampler

    page = 16
    max_len = -(-(sizes.prompt_len + sizes.new_tokens) // page) * page
    config = SamplerConfig(
        num_slots=batch,
        max_seq_len=max_len,
        page_size=page,
        chunk_steps=min(16, sizes.new_tokens),
        max_prefill_rows=min(batch, 64),
        prefill_chunk=-(-sizes.prompt_len // page) * page,  # every prompt in one piece
        cache_dtype="bfloat16",
        head_dtype="bfloat16",
        attention="paged",
        min_window_pages=max_len // page,  # one decode compile per batch size
    )
    return PagedSampler(graphdef, params, config)


def stage_decode(ctx: Stage, args, sizes: Sizes, gpu) -> None:
    import jax
    import numpy as np

    from bench import common
    from pipelinerl_jax.kernels import paged_attention as pa
    from pipelinerl_jax.models import decoder
    from pipelinerl_jax.sampler.sequence import SamplingParams

    rows, skipped = ctx.rec.setdefault("rows", []), ctx.rec.setdefault("skipped", [])
    ctx.rec["config"] = dict(
        prompt_len=sizes.prompt_len,
        new_tokens=sizes.new_tokens,
        temperature=sizes.temperature,
        repeats=sizes.repeats,
        dtypes="bf16 params, KV cache and LM head on both sides",
        attention="paged (" + ("Triton kernel" if pa.triton_available() else "jnp reference") + ")",
        tok_s="generated tokens / wall time of the whole generate call, prefill included",
        predicted="roofline decode steps at mean context prompt + new/2; prefill not counted",
    )
    device, why_not = _torch_device(args)
    ctx.rec["hf_device"] = device or why_not
    ctx.rec["hf_dtype"] = "bfloat16" if device == "cuda" else "float32 (torch CPU)"
    models = list(sizes.decode_models)
    for i, name in enumerate(models):
        # Each model gets an equal share of what is left, so one slow model cannot starve the rest.
        model_deadline = ctx.check.elapsed() + ctx.left() / (len(models) - i)
        if ctx.left() <= 0:
            skipped.extend(
                dict(model=name, batch=b, reason="decode budget spent") for b in sizes.batches
            )
            continue
        cfg = model_config(
            name, args.cpu_rehearsal, param_dtype="bfloat16", compute_dtype="bfloat16"
        )
        graphdef, params = decoder.init(cfg, jax.random.key(0))
        hf_model, hf_error = None, why_not
        if device is not None:
            try:
                hf_model = _hf_model(cfg, params, device)
            except Exception as e:  # noqa: BLE001 - ours is still measured
                hf_error = f"transformers model not built: {type(e).__name__}: {e}"
                ctx.log(hf_error)
        for j, batch in enumerate(sizes.batches):
            if ctx.check.elapsed() > model_deadline:
                skipped.append(
                    dict(model=name, batch=batch, reason="model's share of budget spent")
                )
                ctx.log(f"{name} batch {batch}: skipped (budget)")
                continue
            row = dict(model=name, params=param_counts.num_params(cfg), batch=batch)
            try:
                prompts = np.random.default_rng(batch).integers(
                    0, cfg.vocab_size, (batch, sizes.prompt_len)
                )
                sampler = _our_sampler(graphdef, params, batch, sizes)
                how = SamplingParams(temperature=sizes.temperature, max_new_tokens=sizes.new_tokens)
                outs, hf_outs = [], []
                fns = {"ours": lambda: outs.append(sampler.generate(list(prompts), params=how))}
                if hf_model is not None:
                    hf_fn = _hf_generate_fn(
                        hf_model, prompts, sizes.new_tokens, sizes.temperature, device
                    )
                    fns["hf"] = lambda: hf_outs.append(hf_fn())
                t = time.perf_counter()
                fns["ours"]()  # compiles
                row["ours_first_call_s"] = time.perf_counter() - t
                if "hf" in fns and j == 0:
                    fns["hf"]()  # the model's first call: CUDA and cuBLAS set-up, untimed
                # Untimed first calls above: no warm-up before each timed call (GPU timings do
                # not suffer the CPU's switching cost that common.alternating_medians describes).
                medians = common.alternating_medians(fns, repeats=sizes.repeats, warmup=0)
                made = sum(len(s.token_ids) for s in outs[-1])
                if made != batch * sizes.new_tokens:
                    raise RuntimeError(f"ours made {made} tokens, not {batch * sizes.new_tokens}")
                if hf_outs and hf_outs[-1].shape[1] - sizes.prompt_len != sizes.new_tokens:
                    got = hf_outs[-1].shape[1] - sizes.prompt_len
                    raise RuntimeError(f"transformers made {got} tokens, not {sizes.new_tokens}")
                tokens = batch * sizes.new_tokens
                row.update(ours_s=medians["ours"][0], ours_times=medians["ours"][1])
                row["ours_tok_s"] = tokens / row["ours_s"]
                if "hf" in medians:
                    row.update(hf_s=medians["hf"][0], hf_times=medians["hf"][1])
                    row["hf_tok_s"] = tokens / row["hf_s"]
                    row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
                else:
                    row["hf_skipped"] = hf_error
                sampler = outs = hf_outs = fns = None  # free the KV pool and outputs now
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: the next row still runs
                row["error"] = f"{type(e).__name__}: {e}"
                ctx.problem(f"decode {name} batch {batch}: {row['error'][:300]}")
            context = sizes.prompt_len + sizes.new_tokens / 2
            row["predicted"] = predict_decode(cfg, gpu, batch=batch, context_len=context)
            if "tok_s" in row["predicted"] and "ours_tok_s" in row:
                row["ours_frac_of_predicted"] = row["ours_tok_s"] / row["predicted"]["tok_s"]
            rows.append(row)
            ctx.log(
                f"{name} batch {batch}: ours {fmt(row.get('ours_tok_s'))} tok/s, transformers "
                f"{fmt(row.get('hf_tok_s'))}, ratio {fmt(row.get('ratio'))}, predicted "
                f"{fmt(row['predicted'].get('tok_s'))}"
            )
            ctx.save()
        del hf_model, params
        free_memory()
    common.print_table(
        rows, ["model", "batch", "ours_tok_s", "hf_tok_s", "ratio", "ours_frac_of_predicted"]
    )
