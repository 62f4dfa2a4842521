"""The shared shape of the package's command-line tools (evaluate, generate, export).

Each tool defines its absl flags on a fresh FlagValues (so tests can call it in-process many
times) and a body that does the work. Bad flags and ConfigErrors become one line on stderr and
exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import Callable

from absl import flags

from pipelinerl_jax.errors import ConfigError


def run(argv: list[str], define_flags: Callable[[flags.FlagValues], None],
        body: Callable[[flags.FlagValues], None]) -> int:
    """Parses argv (argv[0] is the program name), runs body(flag_values); returns the exit code."""
    fv = flags.FlagValues()
    define_flags(fv)
    try:
        fv(argv)
        body(fv)
    except (flags.Error, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
