"""bench/report.py: the README table comes from result files, and says so when one is missing."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402


def test_table_renders_results_and_marks_missing_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    decode = {"load_before": {"loadavg_1m": 0.25}, "date": "2026-11-24T22:32:20+00:00",
              "cpu": {"model": "Intel(R) Xeon(R) Processor", "amx_bf16": True}, "rows": [
        {"batch": 8, "dtype": "float32", "ours_tok_s": 300.4, "hf_tok_s": 150.2, "ratio": 2.0,
         "frac_f32_matmul_peak": 0.2}],
        "param_swap": {"batch": 8, "extra_cost_in_decode_steps": 0.31, "recompiled": False}}
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    text = report.table()
    assert "| decode float32, batch 8: tokens/s | 300 (20% of f32 peak) | 150 | 2.00x |" in text
    assert "0.31 decode steps" in text and "(0.2)" in text
    assert "| Intel Xeon (AMX), 2026-11-24 |" in text   # which machine made the figure
    assert "forward: not measured yet" in text  # no forward.json: no number invented
    (tmp_path / "forward.json").write_text(json.dumps({"date": "2026-11-22T04:01:32", "rows": [
        {"impl": "pipelinerl_jax", "dtype": "float32", "tokens_per_s": 884.0,
         "frac_f32_peak": 0.62, "median_s": 1.0},
        {"impl": "transformers", "dtype": "float32", "tokens_per_s": 1009.0,
         "median_s": 1.14}]}))
    assert "| cpu not recorded, 2026-11-22 |" in report.table()  # older results say so
    decode["command"] = "python bench/bench_decode.py --batches 8"
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    assert "`python bench/bench_decode.py --batches 8` (0.2)" in report.table()


def test_readme_without_markers_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    (tmp_path / "README.md").write_text("# no table here\n")
    monkeypatch.setattr(sys, "argv", ["report.py", "--readme"])
    assert report.main() == 2
    assert "lacks the markers" in capsys.readouterr().err
    assert (tmp_path / "README.md").read_text() == "# no table here\n"  # untouched
