"""Bench scripts refuse bad flags in one line on stderr, exit code 2, before any work: no
setup, no timing, no run launched, no result lost after the work (bench/common.py's checks)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402


@pytest.fixture
def no_work(monkeypatch):
    """Any bench that gets as far as its load check or a launch fails the test."""

    def started(*a, **k):
        raise AssertionError("the bench started work before refusing its flags")

    monkeypatch.setattr(common, "warn_if_busy", started)
    monkeypatch.setattr(common, "run_launch", started)


def refused(main, argv, capsys) -> str:
    """The one line `main(argv)` printed on stderr when it refused with exit code 2."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--batches=abc"], "--batches=abc: give a comma-separated list like 1,8"),
        (["--batches=0"], "--batches=0: give a comma-separated list"),
        (["--batches=-4"], "--batches=-4: give a comma-separated list"),
        (["--batches=8,8"], "--batches=8,8: a value appears twice"),
        (["--repeats=0"], "--repeats=0: give 1 or more"),
        (["--repeats=-1"], "--repeats=-1: give 1 or more"),
        (["--new_tokens=0"], "--new_tokens=0: give 1 or more"),
        (["--chunk_steps=0"], "--chunk_steps=0: give 1 or more"),
        (["--new_tokens=8"], "give --chunk_steps below --new_tokens"),
        (["--quick", "--batches=4"], "--quick sets its own sizes: leave out --batches"),
        (["--repeats=x"], "argument --repeats: invalid int value: 'x'"),
    ],
)
def test_bench_decode_refuses_bad_sizes(argv, says, capsys, monkeypatch, no_work):
    from bench import bench_decode

    monkeypatch.setattr(common, "f32_matmul_gflops", lambda **k: pytest.fail("timed"))
    assert says in refused(bench_decode.main, argv, capsys)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--dtypes=float8", "--quick"], "--dtypes=float8: unknown ['float8']"),
        (["--repeats=0"], "--repeats=0: give 1 or more"),
        (["--repeats=-2"], "--repeats=-2: give 1 or more"),
        (["--batch=0"], "--batch=0: give 1 or more"),
    ],
)
def test_bench_forward_refuses_before_the_matmul_rate(argv, says, capsys, monkeypatch):
    from bench import bench_forward

    monkeypatch.setattr(bench_forward, "warn_if_busy", lambda: pytest.fail("work started"))
    assert says in refused(bench_forward.main, argv, capsys)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--name=a/b", "--steps=2"], "--name='a/b': use letters, digits"),
        (["--name=.."], "--name='..'"),
        (["--steps=0"], "--steps=0: give 1 or more"),
        (["--config=configs/nope.py"], "config error: --config="),
        (["--config=configs/tiny.py", "--set=nope=1"], "config error: --config.nope: no such"),
        (["--config=configs/tiny.py", "--set=batch_size=abc"], "expected an integer"),
    ],
)
def test_bench_filtering_refuses_before_either_run(argv, says, capsys, no_work):
    from bench import bench_filtering

    assert says in refused(bench_filtering.main, argv, capsys)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--name=a/b"], "--name='a/b'"),
        (["--repeats=0"], "--repeats=0: give 1 or more"),
        (["--steps=10"], "--steps=10 with --warmup=20: give --steps of at least --warmup + 2"),
        (["--swap_chunks=2,x"], "--swap_chunks=2,x: give a comma-separated list like 0,2,8"),
        (["--checkpoint_every=0"], "--checkpoint_every=0: give 1 or more"),
        (["--config=configs/tiny.py", "--steps=30", "--set=x"], "unrecognized arguments"),
    ],
)
def test_bench_deterministic_refuses_before_any_run(argv, says, capsys, no_work):
    from bench import bench_deterministic

    assert says in refused(bench_deterministic.main, argv, capsys)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--seeds", "0", "0"], "--seeds 0 0: a seed appears twice"),
        (["--set=nope=1"], "config error: --config.nope: no such field"),
        (["--set=steps=0"], "config error: config.steps=0 must be >= 1"),
    ],
)
def test_demo_seeds_refuses_in_one_line_with_exit_2(argv, says, capsys, monkeypatch):
    from bench import demo_seeds

    monkeypatch.setattr(demo_seeds, "warn_if_busy", lambda: pytest.fail("work started"))
    assert says in refused(demo_seeds.main, argv, capsys)


@pytest.mark.parametrize("name", ["a/b", "..", ".hidden", "", "a b", "x\\y"])
def test_result_name_refuses_what_is_not_a_plain_file_name(name, capsys):
    assert "it names a file in bench/results" in refused(common.result_name, name, capsys)


def test_result_name_keeps_the_names_the_docs_use():
    for name in ("real_learning_bf16", "bench_trim_lora", "demo_seed1", "v1.2-x"):
        assert common.result_name(name) == name


def test_number_and_name_lists():
    assert common.number_list("1,8", "--batches", minimum=1) == [1, 8]
    assert common.number_list("0.8,1", "--t", kind=float, minimum=0) == [0.8, 1.0]
    assert common.names_list("float32", "--dtypes", ("float32", "bfloat16")) == ["float32"]
    assert common.at_least(None, "--x") is None  # not given: the caller's default applies


def test_output_file_refuses_a_directory_and_an_unmakeable_folder(tmp_path, capsys):
    assert "is a directory" in refused(common.output_file, str(tmp_path), capsys)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "cannot make its folder" in refused(common.output_file, str(blocker / "x.csv"), capsys)
    assert common.output_file(str(tmp_path / "new" / "x.csv")) == tmp_path / "new" / "x.csv"


def test_run_launch_exits_with_the_runs_code_and_adds_nothing_to_a_refusal(capfd):
    say = "import sys; print('config error: x', file=sys.stderr); sys.exit(2)"
    assert refused(common.run_launch, [sys.executable, "-c", say], capfd) == "config error: x"
    with pytest.raises(SystemExit) as exited:
        common.run_launch([sys.executable, "-c", "import sys; sys.exit(1)"])
    assert exited.value.code == 1
    assert capfd.readouterr().err.strip() == "error: launch.py exited 1"


def _script(name: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / name), *args],
        capture_output=True,
        text=True,
        timeout=60,
        **kw,
    )


def test_rss_trace_refuses_before_running_the_command(tmp_path):
    marker = tmp_path / "ran"
    touch = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for args, says in (
        ([f"--out={tmp_path}", "--", *touch], "is a directory; give a file path"),
        (
            [f"--out={tmp_path / 'a.csv'}", "--", "/nonexistent_cmd"],
            "cannot run '/nonexistent_cmd'",
        ),
    ):
        proc = _script("rss_trace.py", *args)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and says in proc.stderr
    assert (
        not marker.exists()
        and not list(tmp_path.glob("*.tmp"))
        and not list(tmp_path.glob("*.csv"))
    )


def test_scripts_refuse_an_unknown_flag_in_one_line():
    """argparse's own errors (usage, then the error) come as one line too."""
    for name in ("bench_decode.py", "demo_seeds.py", "bench_pipeline.py"):
        proc = _script(name, "--bogus=1")
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [
            f"error: unrecognized arguments: --bogus=1 ({name} --help lists the flags)"
        ]


def test_quick_refuses_the_sizes_it_would_ignore(capsys):
    parser = common.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=60)
    common.quick_alone(parser.parse_args(["--quick"]), parser, ("repeats", "steps"))
    common.quick_alone(parser.parse_args(["--repeats=3"]), parser, ("repeats", "steps"))
    common.quick_alone(parser.parse_args(["--quick", "--steps=60"]), parser, ("steps",))
    args = parser.parse_args(["--quick", "--repeats=3", "--steps=5"])
    line = refused(lambda _: common.quick_alone(args, parser, ("repeats", "steps")), [], capsys)
    assert line == "error: --quick sets its own sizes: leave out --repeats, --steps"
