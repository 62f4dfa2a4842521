"""bench/bench_vs_trl.py's modes as configs: what each side is set to, and a refused mix.

The timed comparison itself runs in bench/ (TRL is a benchmark-only dependency); these check
that `--compute_dtype=bfloat16` gives our side bf16 compute with the sampler following it, that
the matched objective survives the new mode, and that its table rows are named apart."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import bench_vs_trl, peer_table  # noqa: E402


def test_compute_dtype_sets_our_model_and_leaves_the_sampler_to_follow_it():
    f32 = bench_vs_trl.real_config(3, "pipeline")
    bf16 = bench_vs_trl.real_config(3, "pipeline", compute_dtype="bfloat16")
    assert f32.model.compute_dtype == "float32"
    assert bf16.model.compute_dtype == "bfloat16"
    assert bf16.sampler.compute_dtype is None  # None: the model's compute dtype
    # Everything TRL's side is matched to stays as it was.
    for cfg in (f32, bf16):
        assert cfg.trainer.loss.objective == "ppo" and cfg.batch.weighting == "token_mean"
        assert cfg.trainer.learning_rate == bench_vs_trl.LR


def test_compute_dtype_with_a_sampler_dtype_is_refused_in_one_line():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_vs_trl.py"),
            "--compute_dtype=bfloat16",
            "--sampler_dtype=bfloat16",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "drop --sampler_dtype" in proc.stderr


def test_bf16_compute_results_get_rows_of_their_own(tmp_path):
    (tmp_path / "by_machine").mkdir()
    base = {"cpu": {"model": "AMD EPYC"}, "date": "2026-11-28T08:00:00"}
    for name, ratio, extra in (
        ("vs_trl", 3.1, {}),
        ("vs_trl_bf16", 3.58, {"compute_dtype": "bfloat16"}),
    ):
        result = {**base, **extra, "samples_per_s_ratio": ratio, "peak_rss_ratio": 0.6}
        (tmp_path / "by_machine" / f"{name}.epyc.json").write_text(json.dumps(result))
    rows = {(r["what"], r["peer"]): r["ratios"] for r in peer_table.rows(tmp_path)}
    what = "SmolLM2-135M RL step, bf16 compute on both sides: samples/s, pipeline mode"
    assert rows[(what, "TRL GRPOTrainer, bf16 autocast")] == {"epyc": 3.58}
    assert rows[("SmolLM2-135M RL step: samples/s, pipeline mode", "TRL GRPOTrainer")] == {
        "epyc": 3.1
    }
