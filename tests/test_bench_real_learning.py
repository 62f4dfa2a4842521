"""bench/real_learning.py --re_estimate: a finished run's estimate recomputed from the flags it
was launched with, kept whole (a flag holding spaces survives), the workdir left out."""

import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import real_learning  # noqa: E402


def _estimated_flags(tmp_path, monkeypatch, launched: dict) -> list[str]:
    seen = []
    monkeypatch.setattr(real_learning, "memory_estimate_gib", lambda f: seen.append(f) or 2.5)
    (tmp_path / "wall_s.json").write_text(json.dumps({"wall_s": 60.0, **launched}))
    real_learning.re_estimate(tmp_path)
    assert json.loads((tmp_path / "wall_s.json").read_text())["estimate_gib"] == 2.5
    return seen[0]


def test_re_estimate_takes_the_stored_flags_whole(tmp_path, monkeypatch):
    flags = ["--config=configs/smollm2_math.py", "--config.model.lora.targets=('q', 'v')"]
    launched = {
        "command": shlex.join(["launch.py", *flags, "--workdir=/x"]),
        "flags": flags,
    }
    assert _estimated_flags(tmp_path, monkeypatch, launched) == flags


def test_re_estimate_reads_a_command_line_from_before_flags_were_stored(tmp_path, monkeypatch):
    flags = ["--config=configs/smollm2_math.py", "--config.model.lora.targets=('q', 'v')"]
    launched = {"command": shlex.join(["/venv/bin/launch.py", *flags, "--workdir=/runs/s0"])}
    assert _estimated_flags(tmp_path, monkeypatch, launched) == flags
