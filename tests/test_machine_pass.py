"""bench/machine_pass.py: which figures a machine kind lacks, and a pass that measures them.

The plan is read from by_machine result files and their dates; the pass runs each step as its
own process under a time limit, logs it, carries on past a failure or a timeout, and refuses
bad flags and missing prerequisites in one line before running anything."""

import datetime
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common, machine_pass  # noqa: E402
from bench.machine_pass import Step  # noqa: E402


def _result(results: Path, name: str, kind: str, date: str) -> None:
    (results / "by_machine").mkdir(parents=True, exist_ok=True)
    path = results / "by_machine" / f"{name}.{kind}.json"
    path.write_text(json.dumps({"date": f"{date}T10:00:00+00:00"}))


def _steps(*names: str) -> tuple[Step, ...]:
    return tuple(Step(n, ("-c", "pass"), 1, ()) for n in names)


def test_plan_runs_what_this_kind_lacks_or_has_only_from_before_since(tmp_path):
    _result(tmp_path, "a", "xeon", "2026-11-20")
    _result(tmp_path, "b", "xeon", "2026-11-27")
    _result(tmp_path, "c", "epyc", "2026-11-27")  # the other kind's figure counts for nothing
    steps = _steps("a", "b", "c")

    def runs(**kw):
        return [s.name for s, _, run in machine_pass.plan(steps, tmp_path, "xeon", **kw) if run]

    assert runs() == ["c"]
    assert runs(since="2026-11-25") == ["a", "c"]
    assert runs(rerun_all=True) == ["a", "b", "c"]
    assert runs(only=["b"]) == ["b"]
    dates = {s.name: d for s, d, _ in machine_pass.plan(steps, tmp_path, "xeon")}
    assert dates == {"a": "2026-11-20", "b": "2026-11-27", "c": None}


def test_a_result_from_before_the_steps_last_change_is_measured_again(tmp_path):
    """A step names the date of the last change that moved its figure: a kind's older result
    is re-measured by a plain pass, a newer one is kept, and --since still applies on top."""
    _result(tmp_path, "a", "xeon", "2026-11-26")
    _result(tmp_path, "b", "xeon", "2026-11-28")
    _result(tmp_path, "c", "xeon", "2026-11-26")
    steps = (
        Step("a", ("-c", "pass"), 1, (), current_since="2026-11-27"),
        Step("b", ("-c", "pass"), 1, (), current_since="2026-11-27"),
        Step("c", ("-c", "pass"), 1, ()),
    )

    def runs(**kw):
        return [s.name for s, _, run in machine_pass.plan(steps, tmp_path, "xeon", **kw) if run]

    assert runs() == ["a"]
    assert runs(since="2026-11-27") == ["a", "c"]
    assert machine_pass.is_stale(steps[0], None) is False  # missing, not stale
    for step in machine_pass.STEPS:  # real steps: real dates
        if step.current_since:
            datetime.date.fromisoformat(step.current_since)


def test_a_result_file_that_does_not_parse_counts_as_missing(tmp_path):
    (tmp_path / "by_machine").mkdir()
    (tmp_path / "by_machine" / "a.xeon.json").write_text("{half written")
    assert machine_pass.result_date(tmp_path, "a", "xeon") is None


def test_missing_needs_name_the_steps_and_the_command(tmp_path):
    steps = (Step("x", (), 1, ("model", "trl")), Step("y", (), 1, ("trl",)))
    needs = {"model": (lambda: True, "make real-model"), "trl": (lambda: False, "pip install trl")}
    assert machine_pass.missing_needs(steps, needs) == [
        "trl is missing (needed by x, y): run `pip install trl`"
    ]


def test_every_real_step_names_known_needs_and_existing_scripts():
    assert len({s.name for s in machine_pass.STEPS}) == len(machine_pass.STEPS)
    for step in machine_pass.STEPS:
        assert set(step.needs) <= set(machine_pass.NEEDS), step.name
        assert (ROOT / step.args[0]).is_file(), step.args[0]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--only=vs_trl,nonsense"], "--only names no step nonsense"),
        (["--since=28.11.2026"], "is not a date"),
        (["--only=vs_trl", "--all"], "--only picks the steps itself"),
    ],
)
def test_bad_flags_are_refused_in_one_line(argv, says, capsys, tmp_path):
    assert machine_pass.main([*argv, f"--root={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_a_missing_prerequisite_stops_the_pass_before_any_step(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    steps = (Step("x", ("-c", "open('ran', 'w')"), 1, ("trl",)),)
    needs = {"trl": (lambda: False, "pip install trl")}
    rc = machine_pass.main([f"--root={tmp_path / 'r'}", "--no_report"], steps=steps, needs=needs)
    assert rc == 2
    assert "run `pip install trl`" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_missing_prerequisite_passes_over_only_the_steps_that_need_it(
    capsys, tmp_path, monkeypatch
):
    """An install that failed (Tunix's venv, say) must not cost the figures that need none."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    steps = (
        Step(
            "tunix_step", ("-c", "import sys; open(sys.argv[1], 'w')", "{root}/ran"), 1, ("tunix",)
        ),
        Step("plain", ("-c", "print('measured')"), 1, ("model",)),
    )
    needs = {"tunix": (lambda: False, "make tunix-venv"), "model": (lambda: True, "x")}
    root = tmp_path / "r"
    rc = machine_pass.main(
        [f"--root={root}", "--no_report", f"--python={sys.executable}"], steps=steps, needs=needs
    )
    assert rc == 1  # not everything was measured
    out = capsys.readouterr().out
    assert "cannot run: tunix is missing (needed by tunix_step): run `make tunix-venv`" in out
    assert "not run, a prerequisite missing: tunix_step" in out
    summary = json.loads((root / "summary.json").read_text())
    assert [(r["step"], r["rc"]) for r in summary["steps"]] == [
        ("tunix_step", "missing tunix"),
        ("plain", 0),
    ]
    assert "measured" in (root / "plain.log").read_text()
    assert not (root / "tunix_step.log").exists() and not (root / "ran").exists()


def test_the_pass_runs_each_step_logs_it_and_carries_on_past_failures(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    steps = (
        Step("ok", ("-c", "print('measured')"), 1, ()),
        Step("fails", ("-c", "import sys; sys.exit(3)"), 1, ()),
        Step("hangs", ("-c", "import time; time.sleep(30)"), 0.02, ()),
        Step("after", ("-c", "import sys; print(sys.argv[1])", "{root}/out"), 1, ()),
    )
    root = tmp_path / "r"
    rc = machine_pass.main(
        [f"--root={root}", "--no_report", f"--python={sys.executable}"], steps=steps, needs={}
    )
    assert rc == 1  # a step failed
    summary = json.loads((root / "summary.json").read_text())
    assert [(r["step"], r["rc"]) for r in summary["steps"]] == [
        ("ok", 0),
        ("fails", 3),
        ("hangs", "timeout"),
        ("after", 0),
    ]
    assert "measured" in (root / "ok.log").read_text()
    assert f"{root}/out" in (root / "after.log").read_text()  # {root} filled in


def test_a_non_empty_root_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "summary.json").write_text("{}")
    rc = machine_pass.main([f"--root={tmp_path / 'r'}", "--no_report"], steps=_steps("a"), needs={})
    assert rc == 2 and "is not empty" in capsys.readouterr().err


def test_a_partial_result_is_run_again_with_its_resume_flags(tmp_path, monkeypatch, capsys):
    """A row-by-row result cut short (`complete: false`) counts as lacking, and its step runs
    with the flags that finish it; a complete one is skipped, --all redoes a partial one whole."""
    results = tmp_path / "results"
    monkeypatch.setattr(common, "RESULTS_DIR", results)
    kind = common.machine_kind(common.cpu_features())
    _result(results, "done", kind, "2026-11-28")
    (results / "by_machine" / f"cut.{kind}.json").write_text(
        json.dumps({"date": "2026-11-28T10:00:00+00:00", "complete": False})
    )
    echo = ("-c", "import sys; print('args', sys.argv[1:])")
    steps = (
        Step("done", echo, 1, (), resume=("--resume",)),
        Step("cut", echo, 1, (), resume=("--resume",)),
    )
    assert machine_pass.is_partial(results, "cut", kind)
    assert not machine_pass.is_partial(results, "done", kind)
    python = f"--python={sys.executable}"
    assert machine_pass.main([f"--root={tmp_path / 'r'}", "--no_report", python], steps=steps) == 0
    assert "partial 2026-11-28" in capsys.readouterr().out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert [r["step"] for r in summary["steps"]] == ["cut"]
    assert "args ['--resume']" in (tmp_path / "r" / "cut.log").read_text()
    rc = machine_pass.main(
        [f"--root={tmp_path / 'all'}", "--no_report", "--all", python], steps=steps
    )
    assert rc == 0
    assert "args []" in (tmp_path / "all" / "cut.log").read_text()
