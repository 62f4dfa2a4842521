"""Ctrl-C during a run: a checkpoint is saved when the next one is due soon; otherwise the run
says that none was saved and which step a relaunch resumes from. KeyboardInterrupt is raised
in the main thread (as SIGINT would) while the trainer thread runs a chosen step."""

import _thread
import signal
import time
from types import SimpleNamespace

import pytest
from test_pipeline_run import FakeState, ScriptedTrainer, tiny_config

from pipelinerl_jax.data.datasets import PromptStream
from pipelinerl_jax.data.tasks import make_task
from pipelinerl_jax.pipeline import components as build_lib
from pipelinerl_jax.pipeline import runner as run_lib
from pipelinerl_jax.pipeline.checkpointing import interrupted
from pipelinerl_jax.pipeline.metrics import METRICS_FILE, read_records
from pipelinerl_jax.train.checkpoint import RunCheckpointer


class InterruptingTrainer:
    """A trainer whose `at_call`-th step presses Ctrl-C, then takes 2 s: the main thread stops
    the run meanwhile, so that step is the last one trained."""

    def __init__(self, trainer, at_call: int):
        self.trainer, self.at_call, self.calls = trainer, at_call, 0

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    def train_step(self, state, batch):
        self.calls += 1
        if self.calls == self.at_call:
            _thread.interrupt_main()
            time.sleep(2.0)
        return self.trainer.train_step(state, batch)


@pytest.fixture(autouse=True)
def sigint_raises_keyboard_interrupt():
    """interrupt_main() does nothing where SIGINT is ignored, as in pytest-xdist's workers (and
    under job wrappers): Python's own handler, as launch.py installs it, for these tests."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def interrupt_at(cfg, at_call, workdir):
    components = build_lib.build(cfg)
    components.trainer = InterruptingTrainer(components.trainer, at_call)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        run_lib.run(
            cfg, str(workdir) if workdir else None, components=components, echo=lines.append
        )
    return [line for line in lines if line.startswith("interrupted")]


def saved_steps(workdir):
    with RunCheckpointer(workdir, read_only=True) as ckpt:
        return ckpt.steps()


def train_steps(workdir):
    return [r["step"] for r in read_records(workdir / METRICS_FILE) if r["kind"] == "train"]


def test_ctrl_c_saves_when_a_checkpoint_is_due_soon_and_the_run_resumes_there(tmp_path):
    cfg = tiny_config(steps=20, checkpoint_every=4)
    lines = interrupt_at(cfg, 3, tmp_path)  # step 3 is the last; checkpoint 4 was due next
    assert lines == [
        "interrupted at step 3: saved a checkpoint (the next was due at step 4); "
        "relaunching with the same --workdir resumes from step 3"
    ]
    assert saved_steps(tmp_path) == [3]
    assert train_steps(tmp_path) == [0, 1, 2]
    assert (tmp_path / "curves.png").exists()
    resumed = []
    summary = run_lib.run(
        tiny_config(steps=4, checkpoint_every=4), str(tmp_path), echo=resumed.append
    )
    assert any(line.startswith("resumed from step 3") for line in resumed)
    assert summary["steps"] == 4 and train_steps(tmp_path) == [0, 1, 2, 3]


def test_ctrl_c_far_from_a_checkpoint_says_none_was_saved_and_where_it_resumes(tmp_path):
    cfg = tiny_config(steps=20, checkpoint_every=4)
    lines = interrupt_at(cfg, 5, tmp_path)  # step 5: checkpoint 4 is saved, 8 is far
    assert lines == [
        "interrupted at step 5: no checkpoint saved (the next was due at step 8); "
        "relaunching with the same --workdir resumes from step 4 and trains step 4 "
        "again"
    ]
    assert saved_steps(tmp_path) == [4]
    assert train_steps(tmp_path) == [0, 1, 2, 3, 4]


def test_ctrl_c_without_a_workdir_says_there_is_nothing_to_resume():
    cfg = tiny_config(steps=20)
    components = build_lib.build(cfg)
    params = components.state.params
    scripted = InterruptingTrainer(ScriptedTrainer(params, params), 2)
    components.trainer, components.state = scripted, FakeState(params)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        run_lib.run(cfg, None, components=components, echo=lines.append)
    assert [line for line in lines if line.startswith("interrupted")] == [
        "interrupted at step 2: no checkpoint saved (checkpoints need --workdir and "
        "checkpoint_every > 0); a relaunch starts over from step 0"
    ]


class _Checkpoints:
    """What interrupted() uses of checkpointing.Checkpoints: the schedule and save()."""

    def __init__(self, every: int, last_saved: int | None):
        self.cfg, self.last_saved, self.saved = (
            SimpleNamespace(checkpoint_every=every, deterministic=False),
            last_saved,
            [],
        )

    def save(self, coord):
        self.saved.append(coord.step)
        self.last_saved = coord.step


@pytest.mark.parametrize("step, last, saves", [(9, 5, True), (2, 0, False), (10, 10, False)])
def test_ctrl_c_with_a_stream_without_state_saves_as_usual_and_promises_no_resume(
    step, last, saves
):
    """The checkpoint still holds the params (export, evaluate), so the save policy is the
    same; only the promise of a resume goes, since the stream's position is not in it."""
    for stream, resumes in (
        (iter(range(3)), False),
        (PromptStream(make_task("copy_digits").source()), True),
    ):
        coord = SimpleNamespace(step=step, stream=stream, stopped=lambda: True)
        ckpt, lines = _Checkpoints(10, last), []
        interrupted(coord, ckpt, lines.append)
        assert ckpt.saved == ([step] if saves else [])
        (line,) = lines
        assert line.startswith(f"interrupted at step {step}: ")
        assert ("relaunching with the same --workdir" in line) == resumes
        assert ("cannot be resumed (its prompt stream has no get_state/set_state)" in line) == (
            not resumes
        )
