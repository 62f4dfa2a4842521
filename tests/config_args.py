"""The RunConfig a launch of a config file with `--config.*` arguments would run, built as
launch.py builds it (split, load, override, convert), without launching anything."""

from pathlib import Path

from pipelinerl_jax import config_cli

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def run_config(*overrides: str, file: str = "tiny.py"):
    """configs/`file` with `overrides` (each a `--config.<field>=<value>` argument)."""
    rest, parsed = config_cli.split_argv(list(overrides))
    assert rest == [], rest
    return config_cli.load_run_config(str(CONFIGS / file), parsed)
