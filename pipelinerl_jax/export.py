"""Export a run's checkpoint, or import a GGUF file, as a Hugging Face model directory.

    python -m pipelinerl_jax.export --workdir=RUN --out=DIR [--step=N] [--tokenizer_dir=DIR]
        [--dtype=bfloat16]
    python -m pipelinerl_jax.export --gguf=FILE --out=DIR [--dtype=float32|bfloat16]

Reads only the params of the newest readable checkpoint (or of --step) from
`RUN/checkpoints` (the optimizer state is not loaded), takes the model's shape from the
checkpoint itself (or from RUN/config.json for checkpoints that do not record it), and writes
config.json, generation_config.json, safetensors and the tokenizer files with
`models.hf_io.save_hf`, into a temporary directory renamed into place. The tokenizer comes
from --tokenizer_dir, else from the run's model.hf_dir. Bad input (no such run, no
checkpoint, unknown step) prints a one-line error and exits with code 2.

With --gguf, a llama.cpp GGUF file (llama architecture, F32/F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0
tensors) is dequantized and written the same way, tokenizer and chat template included, by
`models.gguf_io.convert` (default dtype float32). A missing, truncated or non-GGUF file, an
unsupported architecture or tensor type is a one-line error, exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from absl import flags

from pipelinerl_jax import cli
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import config_json, decoder, gguf_io, hf_io, lora, param_counts, peft_io
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.models.hf_io import load_hf, read_config, save_hf
from pipelinerl_jax.train.checkpoint import CHECKPOINT_DIR, CorruptCheckpointError, RunCheckpointer
from pipelinerl_jax.train.json_items import model_config_from_json

log = logging.getLogger(__name__)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "workdir", None, "Run directory (holds checkpoints/ and config.json).", flag_values=fv
    )
    flags.DEFINE_string(
        "gguf", None, "A llama.cpp GGUF file to import instead of a run.", flag_values=fv
    )
    flags.DEFINE_integer(
        "step", None, "Checkpoint step to export; default: the newest.", flag_values=fv
    )
    flags.DEFINE_string("out", None, "Output Hugging Face directory.", flag_values=fv)
    flags.DEFINE_string(
        "tokenizer_dir",
        None,
        "Directory whose tokenizer files to copy; "
        "default: the run's model.hf_dir when it has tokenizer.json.",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "dtype",
        None,
        ["float32", "bfloat16"],
        "Cast the weights; default: keep the training param dtype.",
        flag_values=fv,
    )
    flags.DEFINE_float("max_shard_gb", 4.0, "Largest safetensors shard (GiB).", flag_values=fv)
    flags.DEFINE_string(
        "peft_out",
        None,
        "A LoRA run's adapters in PEFT's format go here; default: <out>/adapter.",
        flag_values=fv,
    )


# --- a run's model, for export and evaluation ------------------------------------------------


def read_run_config(workdir: str | os.PathLike) -> dict | None:
    """The run's config.json (written by pipeline/runner.py) as a dict, or None if absent."""
    path = Path(workdir) / "config.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None


def model_config_from_run(run_config: dict) -> ModelConfig:
    """ModelConfig from a run config dict's model section (model.hf_dir or model.init)."""
    model = run_config.get("model") or {}
    dtypes = {k: model[k] for k in ("param_dtype", "compute_dtype") if model.get(k)}
    init = model.get("init")
    if init:
        fields = dict(init)
        fields.update(dtypes)

        return model_config_from_json(fields)
    if model.get("hf_dir"):
        return config_json.from_hf(read_config(model["hf_dir"]), **dtypes)
    raise ConfigError("the run config has neither model.init nor model.hf_dir")


def load_model(workdir: str | os.PathLike, step: int | None = None):
    """(step, ModelConfig, graphdef, params) of a run's checkpoint: the newest readable step,
    or `step`. Only the params are read. One-line ConfigErrors for a missing run, no
    checkpoint, an unknown or unreadable step, or an unknown model config."""

    workdir = Path(workdir)
    if not workdir.is_dir():
        raise ConfigError(f"--workdir={workdir}: directory does not exist")
    ckpt = RunCheckpointer(workdir, read_only=True)
    steps = ckpt.steps()
    if not steps:
        raise ConfigError(
            f"{workdir / CHECKPOINT_DIR}: no checkpoints (a run saves one every "
            "checkpoint_every steps and at its end)"
        )
    if step is not None and step not in steps:
        raise ConfigError(
            f"--step={step}: no such checkpoint in {ckpt.directory}; available steps: {steps}"
        )
    run_config = None
    for s in [step] if step is not None else list(reversed(steps)):
        try:
            meta = ckpt.read_json(s, "meta")
            if meta.get("model_config"):
                cfg = model_config_from_json(meta["model_config"])
            else:
                run_config = run_config or read_run_config(workdir)
                if run_config is None:
                    raise ConfigError(
                        f"{workdir}: the checkpoint does not record its model and "
                        "there is no config.json; cannot tell the model's shape"
                    )
                cfg = model_config_from_run(run_config)
            graphdef, abstract_params = decoder.abstract_init(cfg)
            if cfg.lora is None:
                return s, cfg, graphdef, ckpt.restore_params(s, abstract_params)
            # LoRA: the checkpoint holds the adapters; the base comes from where the run took it.
            adapters = ckpt.restore_params(s, lora.split(abstract_params)[0])
            base = _lora_base(workdir, cfg, ckpt.read_json(s, "extra").get("lora_base"), s)
            return s, cfg, graphdef, lora.merge(decoder.arrays(adapters), base)
        except CorruptCheckpointError as e:
            if step is not None:
                raise ConfigError(
                    f"checkpoint step {s} is unreadable ({e}); pick another --step of {steps}"
                ) from None
            log.warning("checkpoint step %d is unreadable (%s); trying the previous one", s, e)
    raise ConfigError(f"none of the checkpoints {steps} in {ckpt.directory} is readable")


def _lora_base(workdir, cfg: ModelConfig, saved: dict | None, step: int) -> dict:
    """The frozen base a LoRA run trained its adapters on: model.hf_dir's weights, or the fresh
    init of its seed; refused (one line) when its fingerprint is not the checkpoint's."""
    import jax

    run_config = read_run_config(workdir)
    if run_config is None:
        raise ConfigError(
            f"{workdir}: a LoRA checkpoint needs the run's config.json to find its base model"
        )
    base_cfg = dataclasses.replace(cfg, lora=None)
    hf_dir = (run_config.get("model") or {}).get("hf_dir")
    if hf_dir:
        _, _, base = load_hf(
            hf_dir,
            param_dtype=cfg.param_dtype,
            compute_dtype=cfg.compute_dtype,
            check_tokenizer=False,
        )
    else:
        _, base = decoder.init(base_cfg, jax.random.key(int(run_config.get("seed", 0))))
    base = decoder.arrays(base)
    if saved is not None and lora.fingerprint(base) != saved["sha256"]:
        where = f"model.hf_dir={hf_dir}" if hf_dir else "the fresh init of the run's seed"
        raise ConfigError(
            f"checkpoint step {step}: its LoRA adapters were trained on other base weights than "
            f"{where} holds now; restore that base model to export or evaluate this run"
        )
    return base


def default_tokenizer_dir(workdir) -> str | None:
    """The run's model.hf_dir when it holds a tokenizer (task runs have none to export)."""
    run_config = read_run_config(workdir) or {}
    hf_dir = (run_config.get("model") or {}).get("hf_dir")
    if hf_dir and (Path(hf_dir) / "tokenizer.json").exists():
        return hf_dir
    return None


def export(
    workdir,
    out,
    *,
    step: int | None = None,
    tokenizer_dir=None,
    dtype: str | None = None,
    max_shard_bytes: int = 4 * 2**30,
    peft_out=None,
) -> dict:
    """Writes the checkpoint's params as a Hugging Face directory; returns what it did. A LoRA
    run's directory holds the merged model, and its adapters are written in PEFT's format to
    `peft_out` (default <out>/adapter), loadable onto the base with peft."""
    import jax
    import jax.numpy as jnp

    if tokenizer_dir is not None and not (Path(tokenizer_dir) / "tokenizer.json").exists():
        raise ConfigError(f"--tokenizer_dir={tokenizer_dir}: no tokenizer.json there")
    # Before the checkpoint loads: an --out that holds the user's files is refused, not
    # replaced (hf_io.check_replaceable), and --peft_out likewise.
    hf_io.check_replaceable(out)
    if peft_out:
        _check_apart(out, peft_out)
        hf_io.check_replaceable(peft_out)
    step, cfg, _, params = load_model(workdir, step)
    if peft_out and cfg.lora is None:
        raise ConfigError(f"--peft_out: {workdir} is not a LoRA run (model.lora); leave it out")
    if dtype and dtype != cfg.param_dtype:
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
        cfg = dataclasses.replace(cfg, param_dtype=dtype)
    tokenizer_dir = tokenizer_dir or default_tokenizer_dir(workdir)
    save_hf(out, cfg, params, tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes)
    adapter = None
    if cfg.lora is not None:
        adapter = str(peft_out or Path(out) / "adapter")
        hf_dir = ((read_run_config(workdir) or {}).get("model") or {}).get("hf_dir")
        base = str(Path(hf_dir).resolve()) if hf_dir else None
        peft_io.save_peft(cfg, params, adapter, base_model_name_or_path=base)
    return {
        "adapter": adapter,
        "step": step,
        "out": str(out),
        "model_type": cfg.model_type,
        "params": param_counts.num_params(cfg),
        "dtype": cfg.param_dtype,
        "tokenizer": str(tokenizer_dir) if tokenizer_dir else None,
    }


def _check_apart(out, peft_out) -> None:
    """Refuses a --peft_out that is --out, holds it, or sits inside it anywhere but
    <out>/adapter (the default): one write would replace the other."""
    merged, adapter = Path(out).resolve(), Path(peft_out).resolve()
    nested = merged.is_relative_to(adapter) or adapter.is_relative_to(merged)
    if nested and adapter != merged / "adapter":
        raise ConfigError(
            f"--peft_out={peft_out} and --out={out} overlap, so one write would replace the "
            "other: give --peft_out a folder of its own, or leave it out for <out>/adapter"
        )


def run_cli(argv: list[str]) -> int:
    """Parses argv (argv[0] is the program name) with fresh flags; returns the exit code."""
    return cli.run(argv, define_flags, _export_cli)


def _export_cli(fv) -> None:
    if fv.gguf is not None:
        _import_gguf_cli(fv)
        return
    for name in ("workdir", "out"):
        if not fv[name].value:
            raise ConfigError(f"--{name} is required")
    if fv.max_shard_gb <= 0:
        raise ConfigError(f"--max_shard_gb={fv.max_shard_gb} must be > 0")
    done = export(
        fv.workdir,
        fv.out,
        step=fv.step,
        tokenizer_dir=fv.tokenizer_dir,
        dtype=fv.dtype,
        max_shard_bytes=int(fv.max_shard_gb * 2**30),
        peft_out=fv.peft_out,
    )
    tok = done["tokenizer"] or "none (pass --tokenizer_dir to include one)"
    adapter = f"; LoRA adapter (PEFT): {done['adapter']}" if done["adapter"] else ""
    print(
        f"exported step {done['step']} of {fv.workdir} to {done['out']}: {done['model_type']}, "
        f"{done['params']:,} params, {done['dtype']}; tokenizer: {tok}{adapter}",
        file=sys.stderr,
    )


def _import_gguf_cli(fv) -> None:

    for name in ("workdir", "step", "tokenizer_dir"):
        if fv[name].value is not None:
            raise ConfigError(
                f"--{name} does not apply to --gguf (a GGUF file carries its own "
                "weights and tokenizer); pass one of them, not both"
            )
    if not fv.out:
        raise ConfigError("--out is required")
    if fv.max_shard_gb <= 0:
        raise ConfigError(f"--max_shard_gb={fv.max_shard_gb} must be > 0")
    done = gguf_io.convert(
        fv.gguf, fv.out, dtype=fv.dtype or "float32", max_shard_bytes=int(fv.max_shard_gb * 2**30)
    )
    print(
        f"imported {fv.gguf} ({', '.join(done['gguf_types'])}) to {done['out']}: "
        f"{done['model_type']}, {done['params']:,} params, {done['dtype']}; tokenizer and chat "
        "template from the GGUF metadata",
        file=sys.stderr,
    )


def main() -> None:
    sys.exit(run_cli(sys.argv))


if __name__ == "__main__":
    main()
