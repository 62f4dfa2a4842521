"""A workdir holds one run, and a launch that would damage it is refused before anything loads:
a second launch while one is going (the workdir's lock), checkpoints a checkpoint_every=0
relaunch would train past and never replace, another run's records with no checkpoint to
resume (starting over the same run is said), lag and length bounds lowered under carried-over
groups, and a checkpoints folder that cannot be written. config.json stays as it was."""

import json

import pytest
from test_pipeline_run import tiny_config

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import runner as run_lib
from pipelinerl_jax.pipeline import workdir_lock
from pipelinerl_jax.train.resume_compat import check_compatible

QUIET = lambda *_: None  # noqa: E731


def test_a_second_launch_into_a_busy_workdir_is_refused(tmp_path):
    with workdir_lock.hold(tmp_path):
        with pytest.raises(ConfigError, match=r"is in use by a run still going \(pid \d+\)"):
            run_lib.run(tiny_config(steps=1), str(tmp_path), echo=QUIET)
        assert not (tmp_path / "config.json").exists()
    # The holder's end releases it (a kill -9 too: the kernel drops a dead process's flock).
    assert run_lib.run(tiny_config(steps=1), str(tmp_path), echo=QUIET)["steps"] == 1


def test_records_without_a_checkpoint_start_over_only_for_the_same_run(tmp_path):
    run_lib.run(tiny_config(steps=2, checkpoint_every=0), str(tmp_path), echo=QUIET)
    before = (tmp_path / "config.json").read_text()
    with pytest.raises(ConfigError) as e:
        run_lib.run(tiny_config(steps=2, seed=5), str(tmp_path), echo=QUIET)
    message = str(e.value)
    assert "holds 2 steps of another run (config.seed: 0 -> 5) and no checkpoint" in message
    assert "\n" not in message and (tmp_path / "config.json").read_text() == before
    lines = []
    run_lib.run(tiny_config(steps=1, checkpoint_every=0), str(tmp_path), echo=lines.append)
    assert any(
        line.startswith(f"no checkpoint in {tmp_path}: starting from step 0") for line in lines
    )


def test_checkpoints_a_relaunch_would_not_replace_are_refused(tmp_path):
    run_lib.run(tiny_config(steps=2, checkpoint_every=2), str(tmp_path), echo=QUIET)
    before = (tmp_path / "config.json").read_text()
    with pytest.raises(ConfigError, match="holds checkpoints up to step 2, and config.checkpoint_"):
        run_lib.run(tiny_config(steps=4, checkpoint_every=0), str(tmp_path), echo=QUIET)
    with pytest.raises(ConfigError, match=r"config.max_lag changed \(1 -> 0\)"):
        run_lib.run(tiny_config(steps=4, checkpoint_every=2, max_lag=0), str(tmp_path), echo=QUIET)
    assert (tmp_path / "config.json").read_text() == before
    assert json.loads(before)["steps"] == 2


def test_bounds_may_grow_but_not_shrink_on_resume():
    saved = {"max_lag": 2, "max_new_tokens": 12, "max_prompt_tokens": 8}
    assert check_compatible(saved, {**saved, "max_lag": 3, "max_new_tokens": 16}) == [
        "max_lag: 2 -> 3",
        "max_new_tokens: 12 -> 16",
    ]
    for field in saved:
        with pytest.raises(ConfigError, match=rf"config.{field} changed .* -> {saved[field] - 1}"):
            check_compatible(saved, {**saved, field: saved[field] - 1})


def test_a_checkpoints_folder_it_cannot_write_is_refused_before_training(tmp_path):
    (tmp_path / "checkpoints").write_text("not a folder")  # refused as root too
    with pytest.raises(ConfigError, match="checkpoints/ is not a writable directory"):
        run_lib.run(tiny_config(steps=2, checkpoint_every=2), str(tmp_path), echo=QUIET)
    assert not (tmp_path / "config.json").exists()


def test_an_unreadable_config_json_is_named_so(tmp_path):
    (tmp_path / "config.json").write_text("{bad")
    with pytest.raises(ConfigError, match=r"not a run's \(unreadable: Expecting property name"):
        run_lib.run(tiny_config(steps=1), str(tmp_path), echo=QUIET)
    assert (tmp_path / "config.json").read_text() == "{bad"
