"""A trainer spanning two processes (`devices.trainer_processes=2`) and one sampler process,
each with two CPU devices, under `launch.py --spawn_local=3`: the trainer mesh has all four
trainer devices, the follower makes every train step the leader makes, step 0 trains what a
single-process run trains, held-out evaluation runs on the gathered params, the multi-process
Orbax checkpoint holds whole arrays a single process can read, and a relaunch resumes from it
with both trainer processes; kill -9 of the follower in that relaunch stops the job, and the
next relaunch resumes from the checkpoint the killed one made.

One run carries all of it (a launch of three processes costs about half a minute of CPU on 2
cores, nearly all start-up): the kill is made in the first relaunch, after it has shown the
resume, and the second relaunch checks what the first would have checked at its end."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from pipelinerl_jax import pipeline, presets
from pipelinerl_jax.distributed.trainer_group import pack_batch, unpack_batch
from pipelinerl_jax.models import decoder
from pipelinerl_jax.rl.batch import SEQUENCE_FIELDS, TOKEN_FIELDS, TrainBatch
from pipelinerl_jax.train.checkpoint import RunCheckpointer
from pipelinerl_jax.train.json_items import model_config_from_json
from tests.launching import kill_9_after_a_checkpoint, launch, launches


def _records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _follower_steps(out: str) -> int:
    line = next(x for x in out.splitlines() if "process 1 (trainer): stopped after" in x)
    return int(line.split("stopped after ")[1].split()[0])


def test_two_trainer_processes_train_checkpoint_and_resume(tmp_path):
    workdir = tmp_path / "run"
    args = [
        "--config=configs/tiny.py",
        "--config.checkpoint_every=3",
        "--config.eval_every=3",
        "--config.eval.num_problems=8",
        "--config.devices.trainer_processes=2",
        "--spawn_local=3",
        f"--workdir={workdir}",
    ]
    done = launch(*args, "--config.steps=6", devices=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "process 1 (trainer): following process 0 on 4 trainer device(s)" in done.stdout
    assert "devices: sampler 2, trainer 4" in done.stdout
    assert _follower_steps(done.stdout) == 6
    train = [r for r in _records(workdir) if r.get("kind") == "train"]
    assert [r["step"] for r in train] == list(range(6))
    assert max(r["lag/token_max"] for r in train) <= train[0]["lag/bound"]
    evals = [r for r in _records(workdir) if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [3, 6] and all(r["num_problems"] == 8 for r in evals)

    # Step 0 (all of it decoded by version 0) trains what one process on one device trains.
    single = pipeline.run(presets.tiny(steps=1, checkpoint_every=0, eval_every=0), tmp_path / "one")
    assert single["steps"] == 1
    step0 = next(r for r in _records(tmp_path / "one") if r.get("kind") == "train")
    assert train[0]["reward/mean"] == step0["reward/mean"]
    assert train[0]["loss"] == pytest.approx(step0["loss"], rel=1e-5)

    # Each process wrote its shards; one process reads the whole arrays back.
    with RunCheckpointer(workdir, read_only=True) as ckpt:
        assert ckpt.steps() == [3, 6]
        model = model_config_from_json(ckpt.read_json(6, "meta")["model_config"])
        step, params = ckpt.restore_latest_params(decoder.abstract_init(model)[1])
    assert step == 6
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))

    # Relaunched: resumes from step 6 with both trainer processes; kill -9 of the follower
    # once the relaunch has made a checkpoint of its own (step 9) stops the job.
    more = [*args, "--config.steps=40"]
    out = kill_9_after_a_checkpoint(more, workdir, 1, "process 1 (trainer)", devices=2)
    assert "resumed from step 6" in out
    # Relaunched again: resumes from that checkpoint, and the follower makes every step.
    again = launch(*args, "--config.steps=12", devices=2)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    runs = launches(_records(workdir))
    assert len(runs) == 3 and runs[1][0]["step"] == 6
    resumed_at = runs[2][0]["step"]
    assert resumed_at >= 9 and resumed_at % 3 == 0, resumed_at
    assert f"resumed from step {resumed_at}" in again.stdout
    assert _follower_steps(again.stdout) == 12 - resumed_at
    assert [r["step"] for r in runs[2] if r.get("kind") == "train"] == list(range(resumed_at, 12))


def test_a_batch_crosses_processes_exactly():
    """The leader's step message carries every field of the batch bit for bit."""
    rng = np.random.default_rng(0)
    rows, t, s = 3, 7, 5
    fields = {name: rng.standard_normal((rows, t)).astype(np.float32) for name in TOKEN_FIELDS}
    fields |= {name: rng.standard_normal(s).astype(np.float32) for name in SEQUENCE_FIELDS}
    fields["tokens"] = rng.integers(0, 50_000, (rows, t), dtype=np.int32)
    back = unpack_batch(pack_batch(TrainBatch(**fields)))
    for name, value in fields.items():
        got = getattr(back, name)
        assert got.dtype == value.dtype and np.array_equal(got, value), name
