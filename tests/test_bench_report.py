"""bench/report.py: the README table comes from result files, and says so when one is missing."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402


def test_table_renders_results_and_marks_missing_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    decode = {"load_before": {"loadavg_1m": 0.25}, "rows": [
        {"batch": 8, "dtype": "float32", "ours_tok_s": 300.4, "hf_tok_s": 150.2, "ratio": 2.0,
         "frac_f32_matmul_peak": 0.2}],
        "param_swap": {"batch": 8, "extra_cost_in_decode_steps": 0.31, "recompiled": False}}
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    text = report.table()
    assert "| decode float32, batch 8: tokens/s | 300 (20% of f32 peak) | 150 | 2.00x |" in text
    assert "0.31 decode steps" in text and "(0.2)" in text
    assert "forward: not measured yet" in text  # no forward.json: no number invented


def test_readme_without_markers_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    (tmp_path / "README.md").write_text("# no table here\n")
    monkeypatch.setattr(sys, "argv", ["report.py", "--readme"])
    assert report.main() == 2
    assert "lacks the markers" in capsys.readouterr().err
    assert (tmp_path / "README.md").read_text() == "# no table here\n"  # untouched
