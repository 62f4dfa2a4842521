"""The shared shape of the package's command-line tools (evaluate, generate, export).

Each tool defines its absl flags on a fresh FlagValues (so tests can call it in-process many
times) and a body that does the work. `--help` (also -h, -?, --helpshort, --helpfull) prints the
tool's module docstring and its flags and returns 0: a fresh FlagValues has no help flags of its
own, and absl's app-level --help would exit 1. Bad flags and ConfigErrors become one line on
stderr and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

from absl import flags

from pipelinerl_jax.errors import ConfigError

HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull")


def wants_help(argv: list[str]) -> str | None:
    """The help flag in argv[1:] (before a `--` separator), or None."""
    for arg in argv[1:]:
        if arg == "--":
            return None
        if arg in HELP_FLAGS:
            return arg
    return None


def usage(doc: str | None, fv: flags.FlagValues, full: bool = False) -> str:
    """The tool's docstring, then its flags (with absl's --flagfile/--undefok when full)."""
    text = (doc or "").strip()
    return f"{text}\n\nflags:\n{fv.get_help(include_special_flags=full).rstrip()}\n"


def run(
    argv: list[str],
    define_flags: Callable[[flags.FlagValues], None],
    body: Callable[[flags.FlagValues], int | None],
) -> int:
    """Parses argv (argv[0] is the program name), runs body(flag_values); returns the exit code:
    2 for a bad flag or config, else what body returns (None: 0)."""
    fv = flags.FlagValues()
    define_flags(fv)
    asked = wants_help(argv)
    if asked:
        doc = getattr(sys.modules.get(define_flags.__module__), "__doc__", None)
        print(usage(doc, fv, full=asked == "--helpfull"))
        return 0
    try:
        fv(argv)
        code = body(fv)
    except (flags.Error, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return code or 0


def check_dir(path: str, *, create: bool, where: str) -> None:
    """A one-line ConfigError unless `path` is, or can become, a writable directory; `where`
    names the flag in the message. create: make it and write a probe file into it (what a run
    does first); else (a dry run) leave the disk alone and check that its nearest existing
    ancestor is a writable directory."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if create and os.path.isdir(probe):
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".write_check_"):
                pass  # creating and removing a file is the whole check
        except OSError as e:
            raise ConfigError(f"{where} is not a writable directory: {e.strerror or e}") from None
        return
    if not os.path.isdir(probe):
        raise ConfigError(f"{where} is not a writable directory: {probe} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not a writable directory: {probe} is read-only")


def check_output_file(path: str, flag: str, inputs: dict[str, str | None] | None = None) -> None:
    """A one-line ConfigError unless a file can be written at `path` (the value of --`flag`)
    without replacing one of the tool's `inputs` ({flag: path}): checked before a tool's work
    starts, so that its result is never lost to a bad path, nor its input to its result."""
    if os.path.isdir(path):
        raise ConfigError(f"--{flag}={path} is a directory; name the file to write")
    for name, given in (inputs or {}).items():
        if (
            given
            and os.path.isfile(given)
            and os.path.exists(path)
            and os.path.samefile(path, given)
        ):
            raise ConfigError(f"--{flag}={path} is the --{name} file; name another file to write")
    check_dir(os.path.dirname(path) or ".", create=True, where=f"--{flag}={path}: its folder")
