"""bench/row_results.py: a result written after every row and carried across runs of one config.

A long benchmark (bench_decode_real.py) must not lose its finished rows to a kill, and a later
run must finish it (resume) or re-measure part of it (a narrower grid) without dropping the
rest; rows from another config must never mix in."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import row_results  # noqa: E402

CONFIG = {"model": "m", "new_tokens": 256}
GRID = [("float32", 1), ("float32", 8), ("bfloat16", 1), ("bfloat16", 8)]


def _writer(out: dict):
    def write(name, payload):
        out[name] = json.loads(json.dumps(payload))  # what would land on disk
        return Path(name)

    return write


def _result(previous=None, written=None):
    return row_results.RowResult(
        "r", CONFIG, ("dtype", "batch"), GRID, previous=previous, write=_writer(written)
    )


def test_each_row_is_written_as_it_is_measured_and_marked_partial_until_the_grid_is_full():
    written = {}
    result = _result(written=written)
    assert result.to_measure(GRID, resume=True) == GRID
    for i, (dtype, batch) in enumerate(GRID):
        result.add({"dtype": dtype, "batch": batch, "ratio": 1.0 + i}, {"cpu": "x"})
        on_disk = written["r"]
        assert [(r["dtype"], r["batch"]) for r in on_disk["rows"]] == GRID[: i + 1]
        assert on_disk["complete"] is (i == len(GRID) - 1)
        assert on_disk["config"] == CONFIG and on_disk["cpu"] == "x"
        assert all(r["date"] for r in on_disk["rows"])


def test_resume_measures_only_what_is_missing_and_a_narrow_grid_keeps_the_rest():
    old = "2026-11-20T10:00:00+00:00"
    previous = {
        "config": CONFIG,
        "date": old,
        "complete": False,
        "rows": [{"dtype": "bfloat16", "batch": 8, "ratio": 9.0}, {"dtype": "float32", "batch": 1}],
    }
    written = {}
    result = _result(previous, written)
    assert result.to_measure(GRID, resume=True) == [("float32", 8), ("bfloat16", 1)]
    assert result.to_measure([("bfloat16", 8)], resume=False) == [("bfloat16", 8)]
    result.add({"dtype": "bfloat16", "batch": 1, "ratio": 2.0}, {})
    on_disk = written["r"]
    # Grid order, the carried rows keep the date of the file they came from, and the file's
    # date is its oldest row's.
    assert [(r["dtype"], r["batch"]) for r in on_disk["rows"]] == [
        ("float32", 1),
        ("bfloat16", 1),
        ("bfloat16", 8),
    ]
    assert on_disk["rows"][2]["ratio"] == 9.0 and on_disk["rows"][2]["date"] == old
    assert on_disk["date"] == old and on_disk["rows"][1]["date"] > old
    assert on_disk["complete"] is False


def test_rows_of_another_config_are_dropped():
    previous = {"config": {**CONFIG, "new_tokens": 16}, "rows": [{"dtype": "float32", "batch": 1}]}
    result = _result(previous, {})
    assert result.rows == {} and result.to_measure(GRID, resume=True) == GRID


def test_kind_result_reads_this_kinds_file_and_tolerates_a_broken_one(tmp_path):
    (tmp_path / "by_machine").mkdir()
    (tmp_path / "by_machine" / "r.xeon.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "by_machine" / "r.epyc.json").write_text("{half")
    assert row_results.kind_result("r", tmp_path, "xeon") == {"rows": []}
    assert row_results.kind_result("r", tmp_path, "epyc") is None
    assert row_results.kind_result("missing", tmp_path, "xeon") is None


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--batches=1,x"], "--batches='1,x' is not a comma-separated list like 1,8"),
        (["--batches=0"], "--batches='0'"),
        (["--dtypes=float16"], "--dtypes='float16'"),
        (["--temperatures="], "--temperatures=''"),
        (["--repeats=0"], "--repeats=0: give 1 or more"),
    ],
)
def test_decode_real_refuses_bad_flags_in_one_line_before_measuring(argv, says, capsys):
    """(A missing --model: test_bench_common's test of every real-model bench.)"""
    from bench import bench_decode_real

    assert bench_decode_real.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
