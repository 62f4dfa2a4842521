"""`launch.py --spawn_local=3`: one trainer and two sampler processes under jax.distributed
run the tiny config end to end, and survive kill -9 of the trainer (the coordinator's
process) or of a sampler through a relaunch. The lag bound holds over both samplers, both decode, every
trained token's version is one the trainer published, and step 0 (all of it decoded by
version 0 in the sampler processes) trains exactly what a single-process run trains: data
order and sampling do not depend on which process decodes. Bad multi-process settings are
one line and exit code 2 before any process starts.

A launch of three processes costs about half a minute of CPU on 2 cores, nearly all of it
start-up, so one run is killed, relaunched, killed again and relaunched to its end, and the
uninterrupted run's checks are made on those launches. The two-trainer-process variant (kill
-9 of the follower) is in test_distributed_trainers.py, sharing that file's runs; processes
launched without a supervisor are in test_distributed_no_supervisor.py."""

import json

import pytest

from pipelinerl_jax import pipeline, presets
from tests.launching import kill_9_after_a_checkpoint, launch, launches


@pytest.mark.parametrize(
    "args,message",
    [
        (["--spawn_local=1", "--config.checkpoint_every=0"], "--spawn_local=1: use 2 or more"),
        (["--num_processes=3", "--config.checkpoint_every=0"], "needs --coordinator=host:port"),
        (
            [
                "--spawn_local=3",
                "--config.checkpoint_every=0",
                "--config.devices.trainer_processes=3",
            ],
            "trainer_processes=3: use 1..2 so that at least one of the 3 processes samples",
        ),
    ],
)
def test_bad_multi_process_settings_are_one_line(tmp_path, args, message):
    done = launch("--config=configs/tiny.py", *args, f"--workdir={tmp_path}", timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


def test_one_trainer_two_samplers_survive_kill_9_and_relaunch(tmp_path):
    workdir = tmp_path / "run"
    args = [
        "--config=configs/tiny.py",
        "--config.steps=40",
        "--config.checkpoint_every=2",
        "--config.eval_every=0",
        "--spawn_local=3",
        f"--workdir={workdir}",
    ]
    # Kill -9 of the trainer (it hosts the coordinator), then of a sampler in the relaunch.
    kill_9_after_a_checkpoint(args, workdir, 0, "process 0 (trainer)")
    out = kill_9_after_a_checkpoint(args, workdir, 2, "process 2 (sampler 1)")
    assert "resumed from step" in out
    done = launch(*[a.replace("steps=40", "steps=12") for a in args], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "resumed from step" in done.stdout

    # Both samplers decoded in the launch that ran to its end.
    served = [
        int(line.split("stopped after ")[1].split()[0])
        for line in done.stdout.splitlines()
        if "stopped after" in line
    ]
    assert len(served) == 2 and all(n > 0 for n in served), done.stdout[-2000:]

    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    runs = launches(records)
    assert len(runs) == 3
    steps = [[r["step"] for r in run if r.get("kind") == "train"] for run in runs]
    assert steps[0] == list(range(len(steps[0])))
    # Each relaunch resumes at the newest checkpoint (the one its predecessor was killed
    # after) and trains on from there in order; the last one to the end.
    resumed = [run[0]["step"] for run in runs[1:]]
    assert 2 <= resumed[0] < resumed[1], resumed
    assert steps[1] == list(range(resumed[0], resumed[0] + len(steps[1])))
    assert steps[2] == list(range(resumed[1], 12))
    train = [r for r in records if r.get("kind") == "train"]
    bound = train[0]["lag/bound"]
    assert max(r["lag/token_max"] for r in train) <= bound
    for r in train:  # tokens trained at step s came from versions 0..s (published ones)
        assert 0 <= r["version/min"] <= r["version/max"] <= r["step"]

    # Step 0 (decoded by version 0 in the sampler processes) is what one process trains.
    single = pipeline.run(presets.tiny(steps=1, checkpoint_every=0, eval_every=0), tmp_path / "one")
    assert single["steps"] == 1
    one = [
        json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
    ]
    step0 = next(r for r in one if r.get("kind") == "train")
    assert train[0]["step"] == 0
    assert train[0]["reward/mean"] == step0["reward/mean"]
    assert train[0]["loss"] == pytest.approx(step0["loss"], rel=1e-5)
