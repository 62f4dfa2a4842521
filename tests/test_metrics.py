"""Lag statistics and the JSONL metrics log."""

import json

import numpy as np

from pipelinerl_jax.pipeline.metrics import MetricsWriter, lag_stats
from pipelinerl_jax.rl.lag import lag_histogram


def test_lag_histogram_buckets_count_every_token():
    rng = np.random.default_rng(0)
    lags = rng.integers(0, 40, size=500)
    hist = lag_histogram(lags)
    assert sum(hist.values()) == 500
    assert hist["0"] == (lags == 0).sum()
    assert hist["4-5"] == ((lags >= 4) & (lags <= 5)).sum()
    assert hist["32+"] == (lags >= 32).sum()


def test_lag_stats_per_token_and_per_sequence():
    versions = np.array([3, 3, 4, 5, 5, 5])
    seq = np.array([0, 0, 0, 1, 1, 2])
    s = lag_stats(versions, current_version=6, sequence_ids=seq)
    assert s["lag/token_max"] == 3
    np.testing.assert_allclose(s["lag/token_mean"], np.mean(6 - versions))
    assert s["lag/seq_max"] == 3  # sequence 0's oldest token
    np.testing.assert_allclose(s["lag/seq_mean"], np.mean([3, 1, 1]))
    np.testing.assert_allclose(s["seq/mixed_version_frac"], 1 / 3)
    assert (s["version/min"], s["version/max"]) == (3, 5)


def test_writer_appends_jsonl(tmp_path):
    lines = []
    writer = MetricsWriter(tmp_path, echo_every=2, echo=lines.append)
    for step in range(4):
        writer.write("train", {"step": step, "loss": np.float32(0.5), "reward/mean": 0.1 * step})
    writer.write("summary", {"steps": 4})
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["train"] * 4 + ["summary"]
    assert records[1]["loss"] == 0.5
    assert len(lines) == 2 and "reward 0.200" in lines[1]
    assert len(writer.of_kind("train")) == 4


def test_a_resume_says_which_steps_the_log_lost(tmp_path):
    """Records lost before the checkpoint (a file cut, lines removed) are said on resume, not
    left to a summary that counts fewer steps than the run trained."""
    writer = MetricsWriter(tmp_path, echo=lambda *_: None)
    writer.start()
    for step in range(6):
        writer.write("train", {"step": step, "loss": 0.1})
    writer.close()
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if '"step": 3' in line and "train" in line)
    path.write_text("".join(lines[:cut]) + lines[cut][:25])  # cut inside step 3's record
    said = []
    again = MetricsWriter(tmp_path, echo=said.append)
    again.start(resumed_from=6)
    again.close()
    assert [r["step"] for r in again.history] == [0, 1, 2]
    assert len(said) == 1 and "holds no record of 3 of the 6 steps" in said[0]
    assert "(first: step 3;" in said[0]
    said.clear()
    whole = MetricsWriter(tmp_path / "other", echo=said.append)
    whole.start()
    whole.close()
    assert said == []
