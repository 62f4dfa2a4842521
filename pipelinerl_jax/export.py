"""Export a run's checkpoint to a Hugging Face model directory.

    python -m pipelinerl_jax.export --workdir=RUN --out=DIR [--step=N] [--tokenizer_dir=DIR]
        [--dtype=bfloat16]

Reads only the params of the newest readable checkpoint (or of --step) from
`RUN/checkpoints` (the optimizer state is not loaded), takes the model's shape from the
checkpoint itself (or from RUN/config.json for checkpoints that do not record it), and writes
config.json, generation_config.json, safetensors and the tokenizer files with
`models.hf_io.save_hf`, into a temporary directory renamed into place. The tokenizer comes
from --tokenizer_dir, else from the run's model.hf_dir. Bad input (no such run, no
checkpoint, unknown step) prints a one-line error and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from absl import flags

from pipelinerl_jax.errors import ConfigError


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("workdir", None, "Run directory (holds checkpoints/ and config.json).",
                        flag_values=fv)
    flags.DEFINE_integer("step", None, "Checkpoint step to export; default: the newest.",
                         flag_values=fv)
    flags.DEFINE_string("out", None, "Output Hugging Face directory.", flag_values=fv)
    flags.DEFINE_string("tokenizer_dir", None, "Directory whose tokenizer files to copy; "
                        "default: the run's model.hf_dir when it has tokenizer.json.",
                        flag_values=fv)
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Cast the weights; default: "
                      "keep the training param dtype.", flag_values=fv)
    flags.DEFINE_float("max_shard_gb", 4.0, "Largest safetensors shard (GiB).", flag_values=fv)


def default_tokenizer_dir(workdir) -> str | None:
    """The run's model.hf_dir when it holds a tokenizer (task runs have none to export)."""
    from pipelinerl_jax.checkpoint import read_run_config
    run_config = read_run_config(workdir) or {}
    hf_dir = (run_config.get("model") or {}).get("hf_dir")
    if hf_dir and (Path(hf_dir) / "tokenizer.json").exists():
        return hf_dir
    return None


def export(workdir, out, *, step: int | None = None, tokenizer_dir=None,
           dtype: str | None = None, max_shard_bytes: int = 4 * 2**30) -> dict:
    """Writes the checkpoint's params as a Hugging Face directory; returns what it did."""
    import jax
    import jax.numpy as jnp

    from pipelinerl_jax.checkpoint import load_model
    from pipelinerl_jax.models.hf_io import save_hf

    if tokenizer_dir is not None and not (Path(tokenizer_dir) / "tokenizer.json").exists():
        raise ConfigError(f"--tokenizer_dir={tokenizer_dir}: no tokenizer.json there")
    step, cfg, _, params = load_model(workdir, step)
    if dtype and dtype != cfg.param_dtype:
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
        cfg = dataclasses.replace(cfg, param_dtype=dtype)
    tokenizer_dir = tokenizer_dir or default_tokenizer_dir(workdir)
    save_hf(out, cfg, params, tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes)
    return {"step": step, "out": str(out), "model_type": cfg.model_type,
            "params": cfg.num_params(), "dtype": cfg.param_dtype,
            "tokenizer": str(tokenizer_dir) if tokenizer_dir else None}


def run_cli(argv: list[str]) -> int:
    """Parses argv (argv[0] is the program name) with fresh flags; returns the exit code."""
    fv = flags.FlagValues()
    define_flags(fv)
    try:
        fv(argv)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        for name in ("workdir", "out"):
            if not fv[name].value:
                raise ConfigError(f"--{name} is required")
        if fv.max_shard_gb <= 0:
            raise ConfigError(f"--max_shard_gb={fv.max_shard_gb} must be > 0")
        done = export(fv.workdir, fv.out, step=fv.step, tokenizer_dir=fv.tokenizer_dir,
                      dtype=fv.dtype, max_shard_bytes=int(fv.max_shard_gb * 2**30))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = done["tokenizer"] or "none (pass --tokenizer_dir to include one)"
    print(f"exported step {done['step']} of {fv.workdir} to {done['out']}: {done['model_type']}, "
          f"{done['params']:,} params, {done['dtype']}; tokenizer: {tok}", file=sys.stderr)
    return 0


def main() -> None:
    sys.exit(run_cli(sys.argv))


if __name__ == "__main__":
    main()
