"""The repository is ruff-formatted (4 spaces, 100 columns) and passes ruff's lint rules.

Both read their settings from pyproject.toml; a failure prints ruff's own report, and
`.venv/bin/ruff format . && .venv/bin/ruff check --fix .` repairs most of it.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "args", [("format", "--check", "--diff"), ("check", "--output-format", "concise")]
)
def test_ruff(args):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "."], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
