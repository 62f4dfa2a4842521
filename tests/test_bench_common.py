"""bench/common.py: peers are timed in alternating rounds, medians per peer."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402


def test_alternating_medians_interleaves_rounds_and_takes_each_median(monkeypatch):
    calls = []
    # A fake clock: each call of a fn advances it by that fn's next duration (binary
    # fractions, so the differences are exact).
    durations = {
        "ours": iter([0.5, 3.0, 1.0, 2.0, 0.25, 9.0, 7.0, 1.0, 6.0, 4.0]),
        "peer": iter([7.0, 4.0, 6.0, 5.0, 8.0, 0.125, 3.0, 1.0, 0.5, 2.0]),
    }
    clock = [0.0]
    monkeypatch.setattr("time.perf_counter", lambda: clock[0])

    def make(name):
        def fn():
            calls.append(name)
            clock[0] += next(durations[name])

        return fn

    out = common.alternating_medians(
        {"ours": make("ours"), "peer": make("peer")}, repeats=5, warmup=1
    )
    # 5 rounds; in each, every fn gets one untimed warm-up call right before its timed one.
    assert calls == ["ours", "ours", "peer", "peer"] * 5
    assert out["ours"] == (3.0, [3.0, 2.0, 9.0, 1.0, 4.0])  # its 2nd, 4th, ... durations
    assert out["peer"] == (2.0, [4.0, 5.0, 0.125, 1.0, 2.0])
