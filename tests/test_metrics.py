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
