"""Generate completions for a JSONL file of prompts with the pipelinerl_jax sampler.

    python -m pipelinerl_jax.generate --model_dir=DIR --prompts=FILE.jsonl --out=OUT.jsonl \\
        [--max_new_tokens=256 --temperature=1.0 --top_p=1.0 --top_k=0 --n=1 --chat]

Each input line is a JSON object with "prompt" (text; with --chat it becomes the user message
of the model's chat template) or "messages" (a chat, always templated), and optionally "id".
Each output line is one sample: id, attempt, prompt, completion, token_ids, logprobs
(behaviour logprobs, f32), versions, finish_reason ("stop" | "length" | "error") and error.
A request that cannot run (e.g. a prompt longer than the context) becomes an "error" line and
the rest proceed; bad flags or files give a one-line error and exit code 2. The output is
written to a temporary name and renamed, so it is never left half-written.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from absl import flags

from pipelinerl_jax import cli
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import hf_io
from pipelinerl_jax.models.tokenizer import Tokenizer
from pipelinerl_jax.sampler import cli_flags
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.sequence import SamplingParams


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "model_dir",
        None,
        "Hugging Face model directory (config.json, safetensors, tokenizer.json).",
        flag_values=fv,
    )
    flags.DEFINE_string("prompts", None, "JSONL file of prompts.", flag_values=fv)
    flags.DEFINE_string("out", None, "Output JSONL file.", flag_values=fv)
    flags.DEFINE_integer("max_new_tokens", 256, "Tokens to generate at most.", flag_values=fv)
    flags.DEFINE_float("temperature", 1.0, "Sampling temperature; 0 = greedy.", flag_values=fv)
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass; 1 = off.", flag_values=fv)
    flags.DEFINE_integer("top_k", 0, "Top-k sampling; 0 = off.", flag_values=fv)
    flags.DEFINE_integer("n", 1, "Samples per prompt (share the prompt's prefill).", flag_values=fv)
    flags.DEFINE_bool("chat", False, "Wrap text prompts in the chat template.", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Sampling seed.", flag_values=fv)
    cli_flags.define(fv, num_slots=16)
    flags.DEFINE_enum(
        "dtype", "float32", ["float32", "bfloat16"], "Param/compute dtype.", flag_values=fv
    )
    flags.DEFINE_bool("progress", True, "Show a progress bar.", flag_values=fv)


def read_prompts(path: str, tokenizer, chat: bool) -> list[dict]:
    """[{id, text, ids}] from a JSONL file; ConfigError with file:line on bad lines."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--prompts={path}: file not found")
    out = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{path}:{lineno}: malformed JSON ({e.msg} at column "
                    f"{e.colno}); each line must be one JSON object"
                ) from None
            if not isinstance(record, dict) or not ("prompt" in record or "messages" in record):
                raise ConfigError(
                    f'{path}:{lineno}: expected an object with "prompt" (text) or "messages" (chat)'
                )
            rid = record.get("id", len(out))
            if "messages" in record:
                text = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True)
                ids = tokenizer.encode(text, add_special_tokens=False)
            elif chat:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": str(record["prompt"])}], add_generation_prompt=True
                )
                ids = tokenizer.encode(text, add_special_tokens=False)
            else:
                text = str(record["prompt"])
                ids = tokenizer.encode(text)
            out.append({"id": rid, "text": text, "ids": ids})
    if not out:
        raise ConfigError(f"{path}: no prompts (the file is empty)")
    return out


def generate_file(fv: flags.FlagValues) -> dict:
    """Runs the whole job; returns counts. Raises ConfigError on bad input."""
    for name in ("model_dir", "prompts", "out"):
        if not fv[name].value:
            raise ConfigError(f"--{name} is required")
    # Before any sampling: a file that cannot be written must not cost the whole generation.
    cli.check_output_file(fv.out, "out", inputs={"prompts": fv.prompts})
    if fv.n < 1 or fv.n > fv.num_slots:
        raise ConfigError(
            f"--n={fv.n} must be between 1 and --num_slots={fv.num_slots}: "
            "raise --num_slots or lower --n"
        )
    if fv.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens={fv.max_new_tokens} must be >= 1")
    cli_flags.check(fv)

    if not Path(fv.model_dir).is_dir():
        raise ConfigError(f"--model_dir={fv.model_dir}: model directory does not exist")
    tokenizer = Tokenizer.from_dir(fv.model_dir)
    prompts = read_prompts(fv.prompts, tokenizer, fv.chat)
    cfg, graphdef, params = hf_io.load_hf(fv.model_dir, param_dtype=fv.dtype)

    sampling = SamplingParams(
        temperature=fv.temperature,
        top_p=fv.top_p,
        top_k=fv.top_k,
        max_new_tokens=fv.max_new_tokens,
        seed=None,
    )
    if sampling.error():
        raise ConfigError(f"sampling flags: {sampling.error()}")
    config = cli_flags.sampler_config(
        fv,
        longest_prompt=max(len(p["ids"]) for p in prompts),
        max_new_tokens=fv.max_new_tokens,
        model_limit=cfg.max_position_embeddings,
    )
    sampler = PagedSampler(graphdef, params, config, eos_token_ids=tokenizer.eos_token_ids)
    for i, p in enumerate(prompts):
        sampler.submit(p["ids"], n=fv.n, params=sampling, request_id=i)

    bar = None
    if fv.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts) * fv.n, desc="samples", unit="sample", file=sys.stderr)
    out_path = Path(fv.out)
    tmp_path = out_path.with_name(out_path.name + ".tmp")
    counts = {"samples": 0, "errors": 0, "tokens": 0}
    results = []
    while sampler.has_work():
        done = sampler.step()
        results.extend(done)
        if bar is not None and done:
            bar.update(len(done))
    if bar is not None:
        bar.close()
    results.sort(key=lambda s: (s.request_id, s.attempt))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tmp_path.open("w", encoding="utf-8") as f:
        for s in results:
            p = prompts[s.request_id]
            f.write(
                json.dumps(
                    {
                        "id": p["id"],
                        "attempt": s.attempt,
                        "prompt": p["text"],
                        "completion": tokenizer.decode(s.token_ids, skip_special_tokens=True),
                        "token_ids": s.token_ids,
                        "logprobs": s.logprobs,
                        "versions": s.versions,
                        "finish_reason": s.finish_reason,
                        "error": s.error,
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
            counts["samples"] += 1
            counts["errors"] += s.finish_reason == "error"
            counts["tokens"] += len(s.token_ids)
    os.replace(tmp_path, out_path)
    return counts


def run_cli(argv: list[str]) -> int:
    """Parses argv (argv[0] is the program name) with fresh flags; returns the exit code."""
    # The sampler logs the KV pool size (how many sequences of what length fit) at INFO.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    def body(fv):
        counts = generate_file(fv)
        print(
            f"wrote {counts['samples']} samples ({counts['tokens']} tokens, "
            f"{counts['errors']} errors) to {fv.out}",
            file=sys.stderr,
        )

    return cli.run(argv, define_flags, body)


def main() -> None:
    sys.exit(run_cli(sys.argv))


if __name__ == "__main__":
    main()
