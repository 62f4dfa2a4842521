"""Every command-line tool answers --help (and -h, --helpfull) with its usage and flags, exit 0;
launch.py's help lists every config field with its value and meaning."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl_jax import config_schema, evaluate, export, generate
from pipelinerl_jax.data import word_problems
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import real_model
from tests.config_args import run_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "tool, flag_names",
    [
        (generate, ["--model_dir", "--prompts", "--out", "--max_new_tokens", "--chat"]),
        (evaluate, ["--model_dir", "--workdir", "--dataset", "--task", "--k", "--greedy"]),
        (export, ["--workdir", "--gguf", "--out", "--step", "--dtype"]),
        (word_problems, ["--split", "--n", "--out"]),
        (real_model, ["--out", "--cache_dir", "--dtype"]),
    ],
)
@pytest.mark.parametrize("asked", ["--help", "-h", "--helpfull"])
def test_tools_answer_help_with_their_flags(tool, flag_names, asked, capsys):
    assert tool.run_cli(["tool", asked]) == 0
    out = capsys.readouterr().out
    assert out.startswith(tool.__doc__.strip().splitlines()[0])
    for name in flag_names:
        assert f"{name}:" in out or f"--[no]{name[2:]}:" in out, name
    assert ("--flagfile" in out) == (asked == "--helpfull")


def test_help_wins_over_other_flags_and_missing_required_ones(capsys):
    assert export.run_cli(["export", "--out=x", "--help"]) == 0
    assert "--gguf" in capsys.readouterr().out
    assert export.run_cli(["export", "--nosuch", "--", "--help"]) == 2  # after --: not a flag


def _launch_help(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_launch_help_lists_every_config_field_with_value_and_meaning():
    proc = _launch_help("--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    out = proc.stdout
    for name in ("--config:", "--workdir:", "--[no]dry_run:", "--verbosity:"):
        assert name in out
    lines = out.splitlines()
    for field in config_schema.fields():
        heads = [
            i
            for i, l in enumerate(lines)
            if l.startswith(f"  --config.{field.path}=")
            or l.startswith(f"  --config.{field.path}  (")
        ]
        assert len(heads) == 1, field.path
        meaning = lines[heads[0] + 1].strip()
        assert meaning == field.doc[: len(meaning)], field.path
    # The value in configs/default.py, and the dataclass default where it differs.
    assert "  --config.trainer.learning_rate=0.001  (float; [built-in 1e-06])" in lines
    assert "  --config.reward.timeout_s=5.0  (float)" in lines
    assert "  --config.trainer.total_steps  (int; default: steps)" in lines


def test_env_options_are_the_environments_keywords():
    """env.options' keys are the shipped environments' (they were the reward table's, so
    --config.env.options.lo=... was 'no such field')."""
    paths = {f.path: f for f in config_schema.fields() if f.path.startswith("env.options.")}
    assert "env.options.success_weight" not in paths
    assert paths["env.options.lo"].doc == "an option of the guess environment"
    assert paths["env.options.timeout_s"].default == 3.0
    assert paths["env.options.max_turns"].default is None  # every environment's
    cfg = run_config(
        "--config.env.options.closeness=0.2", "--config.env.options.lo=0", file="guess.py"
    )
    assert dict(cfg.env.options)["closeness"] == 0.2 and cfg.env.make().closeness == 0.2
    with pytest.raises(ConfigError, match="environment 'guess' has no such option"):
        run_config("--config.env.options.timeout_s=2", file="guess.py")


def test_launch_help_shows_the_chosen_file_and_overrides_and_helpfull_adds_absl():
    proc = _launch_help("--config=configs/tiny.py", "--config.seed=5", "--helpfull")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the value in configs/tiny.py" in proc.stdout
    assert "  --config.seed=5  (int; [built-in 0])" in proc.stdout.splitlines()
    assert "absl.logging:" in proc.stdout and "--[no]logtostderr" in proc.stdout


def test_planner_answers_help_with_exit_0():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl_jax.plan", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("Layout planner CLI")
    for name in ("--devices:", "--batch:", "--max_lag:", "--profile:"):
        assert name in proc.stdout
