"""What a run leaves in its workdir, across a kill and a resume: metrics.jsonl written before
each checkpoint, TensorBoard events equal to the metrics, curves.png, a finished run that is
left alone, a refused config change that leaves config.json as it was, and a summary that
covers the whole run.

One workdir goes through it all (a tiny config, ~15 s): a first run to step 3 with a
checkpoint at step 2; its step-3 checkpoint is deleted (a kill -9 after the step-2 checkpoint:
step 2's record is in metrics.jsonl but the checkpoint does not cover it); a relaunch with
steps=4 trains steps 2 and 3 again; a relaunch at steps=4 finds the run finished.
"""

import json
import shutil

import pytest
from PIL import Image
from test_pipeline_run import tiny_config
from test_tensorboard_log import assert_events_match_records, read_events

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import checkpointing
from pipelinerl_jax.pipeline import runner as run_lib
from pipelinerl_jax.pipeline.metrics import METRICS_FILE, TENSORBOARD_DIR, read_records, run_history
from pipelinerl_jax.train import checkpoint as checkpoint_lib

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def config(**overrides):
    return tiny_config(
        **{"checkpoint_every": 2, "eval_every": 2, "eval.num_problems": 4, **overrides}
    )


def train_steps(workdir) -> list[int]:
    return [r["step"] for r in read_records(workdir / METRICS_FILE) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The workdir after: run to 3, lose the step-3 checkpoint, resume to 4."""
    wd = tmp_path_factory.mktemp("run")
    saves, plots = [], []
    real_save, real_plot = checkpoint_lib.RunCheckpointer.save, checkpointing.plot_run

    def save(self, step, state, extra):
        saves.append((step, train_steps(wd)))  # what a kill right after this save would leave
        return real_save(self, step, state, extra)

    def plot(train, evals, path, **kw):
        plots.append(max(r["step"] for r in train))
        return real_plot(train, evals, path, **kw)

    lines = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint_lib.RunCheckpointer, "save", save)
        mp.setattr(checkpointing, "plot_run", plot)
        first = run_lib.run(config(steps=3), str(wd), echo=lines.append)
        shutil.rmtree(wd / "checkpoints" / "3")  # as if killed before the final save
        second = run_lib.run(config(steps=4), str(wd), echo=lines.append)
    return dict(wd=wd, saves=saves, plots=plots, first=first, second=second, lines=lines)


def test_every_checkpoint_finds_the_records_of_the_steps_it_holds(workdir):
    assert [step for step, _ in workdir["saves"]] == [2, 3, 4]  # run 1, then the resume
    for step, logged in workdir["saves"]:
        assert set(range(step)) <= set(logged), (step, logged)


def test_tensorboard_events_equal_the_metrics(workdir):
    wd = workdir["wd"]
    kept = run_history(read_records(wd / METRICS_FILE))
    assert [r["step"] for r in kept if r["kind"] == "train"] == [0, 1, 2, 3]
    # The killed run's eval at step 3 came after the checkpoint the resume started from.
    assert [r["step"] for r in kept if r["kind"] == "eval"] == [2, 4]
    events = read_events(wd / TENSORBOARD_DIR)
    assert {"train/reward/mean", "train/loss", "train/entropy", "eval/avg_at_k"} <= set(events)
    # Step 2 was trained twice (killed run, then the resume): TensorBoard shows the second.
    assert_events_match_records(events, kept)


def test_curves_png_at_each_checkpoint_and_at_the_end(workdir):
    # Run 1: the checkpoint after step 2 (records to step 1), the end (step 2); the resume:
    # checkpoint 4 is the final one, so only the end (step 3).
    assert workdir["plots"] == [1, 2, 3]
    path = workdir["wd"] / "curves.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and min(image.size) >= 400


def test_summary_after_a_resume_covers_the_whole_run(workdir):
    summary = workdir["second"]
    assert summary["steps"] == 4 and summary["resumed_from"] == 2
    kept = [
        r for r in run_history(read_records(workdir["wd"] / METRICS_FILE)) if r["kind"] == "train"
    ]
    rewards = [r["reward/mean"] for r in kept]
    assert summary["reward/first20"] == pytest.approx(sum(rewards) / 4)
    assert [s for s, _ in summary["eval/avg@k_by_step"]] == [2, 4]
    assert sum(summary["lag/hist"].values()) == sum(r["lag/tokens"] for r in kept)
    assert any(
        line.startswith("done: 4 steps") and "resumed at step 2" in line
        for line in workdir["lines"]
    )


def test_a_finished_run_says_so_and_writes_nothing(workdir):
    wd = workdir["wd"]
    before = {name: (wd / name).read_bytes() for name in (METRICS_FILE, "config.json")}
    lines = []
    result = run_lib.run(
        config(steps=4, **{"trainer.learning_rate": 1e-4}), str(wd), echo=lines.append
    )
    assert result == {"finished_at": 4}
    assert lines == [
        "already finished at step 4 (config.steps=4): nothing to train; raise "
        "config.steps to train it further"
    ]
    assert {name: (wd / name).read_bytes() for name in before} == before


def test_a_refused_config_change_leaves_config_json_as_it_was(workdir):
    wd = workdir["wd"]
    before = (wd / "config.json").read_text()
    assert json.loads(before)["steps"] == 4
    with pytest.raises(ConfigError, match="config.seed changed"):
        run_lib.run(config(steps=8, seed=5), str(wd), echo=lambda *_: None)
    assert (wd / "config.json").read_text() == before
