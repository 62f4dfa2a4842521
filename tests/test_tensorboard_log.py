"""TensorBoard events of the metrics writer, read back with TensorBoard's own reader: every
scalar of each train and eval record by step, and a resume that re-does steps shows them once."""

import math

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from pipelinerl_jax.pipeline.metrics import (
    METRICS_FILE,
    TENSORBOARD_DIR,
    MetricsWriter,
    read_records,
    run_history,
)
from pipelinerl_jax.pipeline.tensorboard_log import scalars


def read_events(logdir) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} as TensorBoard would show it (orphaned events purged; a tag whose
    every event was purged has nothing to show)."""
    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    events = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    return {tag: by_step for tag, by_step in events.items() if by_step}


def assert_events_match_records(events, records):
    """Every scalar of every train/eval record is an event at its step, and nothing else is."""
    expected: dict[str, dict[int, float]] = {}
    for r in records:
        if r["kind"] in ("train", "eval"):
            for tag, value in scalars(r).items():
                expected.setdefault(f"{r['kind']}/{tag}", {})[r["step"]] = value
    assert set(events) == set(expected)
    for tag, by_step in expected.items():
        assert set(events[tag]) == set(by_step), tag
        for step, value in by_step.items():
            got = events[tag][step]
            if math.isnan(value):
                assert math.isnan(got), (tag, step)
            else:
                np.testing.assert_allclose(got, value, rtol=1e-6, err_msg=f"{tag} @ {step}")


def train_record(step, scale=1.0):
    return {
        "step": step,
        "reward/mean": 0.1 * step * scale,
        "loss": float("nan") if step == 1 else -0.01 * step,
        "lag/hist": {"0": 3 * step, "1": 2},
        "ok": True,
        "prompts": ["a", "b"],
        "note": "text",
    }


def test_scalars_flatten_nested_numbers_and_skip_the_rest():
    got = scalars(
        {
            "kind": "train",
            "step": 3,
            "a": 1,
            "b": {"c": 2.5, "d": {"e": False}},
            "s": "x",
            "l": [1, 2],
            "n": np.float32(0.5),
            "avg@k": 0.25,
            "hist": {"32+": 4},
        }
    )
    assert got == {
        "a": 1.0,
        "b/c": 2.5,
        "b/d/e": 0.0,
        "n": 0.5,
        "avg_at_k": 0.25,
        "hist/32_plus": 4.0,
    }


def test_every_scalar_of_train_and_eval_records_is_an_event(tmp_path):
    writer = MetricsWriter(tmp_path, echo_every=0)
    for step in range(4):
        writer.write("train", train_record(step))
    writer.write("eval", {"step": 4, "avg@k": 0.25, "pass@k": 0.5, "status": {"correct": 3}})
    writer.write("summary", {"steps": 4})
    writer.close()
    events = read_events(tmp_path / TENSORBOARD_DIR)
    assert events["train/reward/mean"][3] == pytest.approx(0.3)
    assert events["eval/status/correct"] == {4: 3.0}
    assert not any(tag.startswith("summary") for tag in events)
    assert_events_match_records(events, read_records(tmp_path / METRICS_FILE))


def test_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    first = MetricsWriter(tmp_path, echo_every=0)
    first.start()
    for step in range(5):  # killed after step 4, its last checkpoint was at step 3
        first.write("train", train_record(step))
    first.write("eval", {"step": 3, "avg@k": 0.5})  # evaluated before the step-3 checkpoint
    first.close()
    last_time = first.records[-1]["time"]

    second = MetricsWriter(tmp_path, echo_every=0)
    second.start(resumed_from=3)
    assert [(r["kind"], r["step"]) for r in second.history] == [
        ("train", 0),
        ("train", 1),
        ("train", 2),
        ("eval", 3),
    ]
    for step in (3, 4, 5):  # trained again (different values) and one more
        second.write("train", train_record(step, scale=-1.0))
    second.close()
    assert second.records[0]["time"] >= last_time  # the run's clock goes on
    assert [r["step"] for r in second.of_kind("train")] == [0, 1, 2, 3, 4, 5]

    events = read_events(tmp_path / TENSORBOARD_DIR)
    assert events["train/reward/mean"][4] == pytest.approx(-0.4)  # the killed run's is gone
    assert events["eval/avg_at_k"] == {3: 0.5}  # the checkpoint's eval stays
    records = read_records(tmp_path / METRICS_FILE)
    assert_events_match_records(events, run_history(records))
    # metrics.jsonl keeps every line ever written (the killed run's steps 3 and 4 too), after
    # a start record per launch; run_history reads it as the run it now is.
    assert sum(r["kind"] == "train" for r in records) == 8
    assert [r for r in records if r["kind"] == "start"] == [
        {"kind": "start", "time": pytest.approx(0.0, abs=0.1), "step": 0, "resumed": False},
        {"kind": "start", "time": pytest.approx(last_time, abs=0.1), "step": 3, "resumed": True},
    ]
    assert [(r["kind"], r["step"]) for r in run_history(records)] == [
        ("train", 0),
        ("train", 1),
        ("train", 2),
        ("eval", 3),
        ("train", 3),
        ("train", 4),
        ("train", 5),
    ]


def test_a_fresh_start_in_a_used_workdir_drops_the_old_run(tmp_path):
    old = MetricsWriter(tmp_path, echo_every=0)
    old.start()
    for step in range(3):
        old.write("train", train_record(step))
    old.close()
    new = MetricsWriter(tmp_path, echo_every=0)
    new.start()  # no checkpoint to resume from: the run starts over
    assert new.of_kind("train") == []
    new.write("train", {"step": 0, "reward/mean": 0.75})
    new.close()
    records = read_records(tmp_path / METRICS_FILE)
    assert [r["reward/mean"] for r in run_history(records)] == [0.75]
    events = read_events(tmp_path / TENSORBOARD_DIR)
    assert events["train/reward/mean"] == {0: 0.75}
    assert_events_match_records(events, run_history(records))


def test_a_line_cut_short_by_a_kill_is_skipped_and_ended(tmp_path):
    writer = MetricsWriter(tmp_path, echo_every=0)
    writer.write("train", train_record(0))
    writer.close()
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"kind": "train", "step": 1, "rew')
    assert [r["step"] for r in read_records(tmp_path / METRICS_FILE)] == [0]
    resumed = MetricsWriter(tmp_path, echo_every=0)  # its first record starts a new line
    resumed.write("train", train_record(1))
    resumed.close()
    assert [r["step"] for r in read_records(tmp_path / METRICS_FILE)] == [0, 1]


_WITHOUT_TORCH_CHILD = """
import sys
import numpy as np
from pipelinerl_jax.pipeline.tensorboard_log import TensorBoardLog
tb = TensorBoardLog(sys.argv[1])
tb.write("train", {"step": 0, "loss": np.float32(0.5), "lag": {"mean": 1.0}})
tb.close()
assert "torch" not in sys.modules, "tensorboardX imported torch"
import torch  # a later import is not blocked
print(float(torch.ones(2).sum()))
"""


def test_the_writer_does_not_import_torch_and_leaves_it_importable(tmp_path):
    """tensorboardX imports torch when it is installed (1 s and 190 MB of a run's start-up);
    the log hides it while tensorboardX imports, and only then."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH_CHILD, str(tmp_path / "tb")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "2.0"
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "train/lag/mean"}
