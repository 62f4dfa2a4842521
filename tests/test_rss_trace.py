"""bench/rss_trace.py: a child's RSS over time, its CSV, and the CLI's bad inputs."""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import rss_trace  # noqa: E402

# A child that holds 256 MiB (every page written, random so no page is shared) for a while,
# frees it, and lingers: the trace must see the rise and the fall.
_CHILD = """
import time, numpy as np
time.sleep(0.6)
block = np.random.default_rng(0).standard_normal(256 * 2**20 // 8)
time.sleep(0.8)
del block
time.sleep(0.6)
"""


def test_trace_sees_an_allocation_come_and_go(tmp_path):
    out = tmp_path / "trace.csv"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD])
    trace = rss_trace.RssTrace(proc.pid, out, interval_s=0.05)
    with trace:
        assert proc.wait() == 0
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["t_s", "rss_gib"]
    t_s = [float(t) for t, _ in rows[1:]]
    gib = [float(g) for _, g in rows[1:]]
    assert len(gib) >= 10 and t_s == sorted(t_s)
    peak = max(gib)
    assert peak - gib[0] > 0.2  # the 0.25 GiB block, over the child's start
    assert peak - gib[-1] > 0.2  # and gone again before it exits
    assert f"peak {peak:.2f} GiB" in trace.summary()
    assert not out.with_name(out.name + ".tmp").exists()


def test_trace_of_an_exited_process_is_empty_not_an_error(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    trace = rss_trace.RssTrace(proc.pid, tmp_path / "t.csv")
    with trace:
        pass
    assert trace.samples == [] and "no samples" in trace.summary()
    assert (tmp_path / "t.csv").read_text().splitlines() == ["t_s,rss_gib"]


def test_cli_runs_the_command_and_passes_its_exit_code(tmp_path):
    out = tmp_path / "t.csv"
    script = str(ROOT / "bench" / "rss_trace.py")
    code = "import time, sys; time.sleep(0.3); sys.exit(3)"
    proc = subprocess.run(
        [sys.executable, script, f"--out={out}", "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 3 and "rss trace:" in proc.stderr and out.exists()


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    script = str(ROOT / "bench" / "rss_trace.py")
    for args, says in (
        ([f"--out={tmp_path / 'a.csv'}"], "no command given"),
        ([f"--out={tmp_path / 'b.csv'}", "--interval_s=0", "--", "true"], "must be > 0"),
    ):
        proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and says in proc.stderr
        assert not list(tmp_path.glob("*.csv"))
