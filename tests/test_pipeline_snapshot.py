"""Coordinator.snapshot / restore: what a checkpoint keeps of the groups started but not yet
trained, through a JSON round trip, and where each kind goes on resume."""

import json

import numpy as np
import pytest
from test_pipeline_run import tiny_config

from pipelinerl_jax.data.datasets import PromptStream
from pipelinerl_jax.data.tasks import make_task
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline.admission import Admission
from pipelinerl_jax.pipeline.coordinator import Coordinator
from pipelinerl_jax.pipeline.groups import Group
from pipelinerl_jax.rewards.tables import Verdict
from pipelinerl_jax.sampler.sampler import Sample


class _NoSampler:
    version = 0  # snapshot / restore never touch the engines


def _coordinator(cfg, stream, admission):
    encode = lambda problem: [ord(ch) % 50 for ch in problem.question]
    return Coordinator(
        cfg,
        sampler=_NoSampler(),
        trainer=None,
        state=None,
        stream=stream,
        encode_prompt=encode,
        detokenize=None,
        reward_pool=None,
        reward_table=None,
        publisher=None,
        admission=admission,
        writer=None,
    )


def _sample(rng, attempt, prompt_ids):
    n = int(rng.integers(2, 6))
    return Sample(
        request_id=7,
        attempt=attempt,
        prompt_ids=prompt_ids,
        token_ids=rng.integers(0, 50, n).tolist(),
        logprobs=(-rng.random(n)).tolist(),
        versions=[3] * (n - 1) + [4],
        start_version=3,
        finish_reason="stop",
    )


def test_snapshot_restore_round_trip():
    cfg = tiny_config()
    source = make_task("reverse_digits").source()
    rng = np.random.default_rng(0)
    admission = Admission(groups_per_step=cfg.groups_per_step, max_lag=cfg.max_lag)
    coord = _coordinator(cfg, PromptStream(source, seed=1), admission)
    coord.step = 5
    drawn = [next(coord.stream) for _ in range(23)]
    admission.restore(23)
    # Group 20: every attempt scored, waiting for the trainer. Group 21: generating (two
    # attempts back, one scored). Group 22: just started, nothing back.
    groups = [
        Group(index=20 + i, problem=drawn[20 + i], prompt_ids=coord.encode_prompt(drawn[20 + i]))
        for i in range(3)
    ]
    scored, partial, fresh = groups
    for a in range(cfg.group_size):
        scored.samples.append(_sample(rng, a, scored.prompt_ids))
        scored.verdicts.append(Verdict(status="wrong" if a else "correct", score=1.0 - a / 4))
        scored.rewards.append(1.0 - a / 4)
    partial.samples = [_sample(rng, a, partial.prompt_ids) for a in range(2)]
    partial.verdicts, partial.rewards = [Verdict(status="no_answer")], [0.0]
    coord.pending = {g.index: g for g in groups}

    snap = json.loads(json.dumps(coord.snapshot()))  # what the checkpoint stores
    assert snap["step"] == 5 and snap["started"] == 23
    assert [g["index"] for g in snap["pending"]] == [20, 21, 22]
    assert "samples" in snap["pending"][0]
    assert "samples" not in snap["pending"][1] and "samples" not in snap["pending"][2]

    admission2 = Admission(groups_per_step=cfg.groups_per_step, max_lag=cfg.max_lag)
    resumed = _coordinator(cfg, PromptStream(source, seed=1), admission2)
    resumed.restore(snap)
    assert resumed.step == 5 and admission2.started == 23
    assert next(resumed.stream).uid == next(coord.stream).uid  # the stream goes on in step
    assert sorted(resumed.pending) == [20, 21, 22]
    # The scored group is ready for the trainer as saved: same samples, rewards, statuses.
    (ready,) = resumed.board.pending()
    assert ready.index == 20 and ready.rewards == scored.rewards
    assert [v.status for v in ready.verdicts] == [v.status for v in scored.verdicts]
    assert [s.token_ids for s in ready.samples] == [s.token_ids for s in scored.samples]
    assert [s.logprobs for s in ready.samples] == [s.logprobs for s in scored.samples]
    assert [s.versions for s in ready.samples] == [s.versions for s in scored.samples]
    # The unscored ones are regenerated first, in start order, from their prompts.
    assert [g.index for g in resumed.requeue] == [21, 22]
    for g, old in zip(resumed.requeue, (partial, fresh)):
        assert g.problem == old.problem and g.prompt_ids == old.prompt_ids
        assert g.samples == [] and g.rewards == []


def test_a_stream_without_state_snapshots_none_and_restores_nothing():
    """A generator's position cannot be saved: the snapshot says so (data None), and neither
    such a snapshot nor a generator can be restored; the refusal leaves the coordinator as
    it was."""
    cfg = tiny_config()
    task = make_task("reverse_digits")
    rng = np.random.default_rng()
    generator = (task.problem(int(i)) for i in rng.integers(0, task.num_problems, 100))
    admission = Admission(groups_per_step=cfg.groups_per_step, max_lag=cfg.max_lag)
    coord = _coordinator(cfg, generator, admission)
    coord.step = int(rng.integers(1, 50))
    snap = json.loads(json.dumps(coord.snapshot()))
    assert snap["data"] is None and snap["step"] == coord.step

    grain = _coordinator(cfg, PromptStream(task.source(), seed=1), admission)
    with pytest.raises(ConfigError, match="holds no stream position"):
        grain.restore(snap)
    with_position = {**snap, "data": grain.stream.get_state(), "started": 7}
    fresh = Admission(groups_per_step=cfg.groups_per_step, max_lag=cfg.max_lag)
    again = _coordinator(cfg, (p for p in [task.problem(0)]), fresh)
    with pytest.raises(ConfigError, match=r"\(generator\) has no get_state/set_state"):
        again.restore(with_position)
    assert again.step == 0 and fresh.started == 0 and not again.pending
