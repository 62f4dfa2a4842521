"""curves.png: a valid PNG of the run's panels, from records or from a workdir's metrics.jsonl."""

import subprocess
import sys
from pathlib import Path

from PIL import Image

from pipelinerl_jax.pipeline.metrics import MetricsWriter
from pipelinerl_jax.pipeline.run_plot import PANELS, PLOT_FILE, main, plot_run

ROOT = Path(__file__).resolve().parents[1]


def train(step):
    return {
        "step": step,
        "reward/mean": 0.01 * step,
        "success": 0.005 * step,
        "entropy": 1.0 / (1 + step),
        "lag/token_mean": 1.2,
        "lag/token_max": 2,
        "lag/bound": 2,
        "samples_per_s": 50.0 + step,
    }


def assert_png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        return image.size


def test_plot_run_writes_a_png_with_every_panel(tmp_path):
    records = [train(s) for s in range(50)]
    records[7]["entropy"] = float("nan")  # a skipped step: a gap, not a failure
    del records[8]["samples_per_s"]
    out = plot_run(
        records,
        [{"step": 0, "avg@k": 0.1, "pass@k": 0.2}, {"step": 50, "avg@k": 0.4, "pass@k": 0.5}],
        tmp_path / PLOT_FILE,
    )
    width, height = assert_png(out)
    assert height >= 150 * len(PANELS) and width >= 600
    assert not list(tmp_path.glob(".*.tmp"))  # written under a temporary name, then renamed


def test_records_without_a_panel_s_keys_still_draw(tmp_path):
    assert_png(plot_run([{"step": 0, "reward/mean": 0.5}], [], tmp_path / "x.png"))


def test_cli_redraws_from_metrics_jsonl(tmp_path):
    writer = MetricsWriter(tmp_path, echo_every=0)
    for step in range(5):
        writer.write("train", train(step))
    writer.close()
    assert main([f"--workdir={tmp_path}"]) == 0
    assert_png(tmp_path / PLOT_FILE)


def test_cli_without_train_records_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl_jax.pipeline.run_plot", f"--workdir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'metrics.jsonl'} has no train records to plot"
    ]
