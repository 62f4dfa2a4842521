"""Dynamic sampling (batch.filter_groups): groups whose raw scores are all alike are dropped on
the raw score, never the shaped reward, and refilled; the lag bound and start order still hold
exactly (a randomized simulation with the real Admission and ReadyBoard); refills are capped;
a run trains full steps, counts what it dropped, and resumes with its drops."""

import json
import threading

import numpy as np
import pytest

from pipelinerl_jax import pipeline, presets
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline.admission import Admission
from pipelinerl_jax.pipeline.filtering import GroupFilter, raw_scores
from pipelinerl_jax.pipeline.groups import Group, ReadyBoard
from pipelinerl_jax.rewards.tables import Verdict
from pipelinerl_jax.rl.config import BatchConfig


def _group(index, scores, rewards=None, statuses=None):
    statuses = statuses or ["correct" if s >= 1 else "wrong" for s in scores]
    g = Group(index=index, problem=None, prompt_ids=[1])
    g.verdicts = [Verdict(status=st, score=s) for st, s in zip(statuses, scores)]
    g.rewards = list(rewards if rewards is not None else scores)
    return g


def test_groups_are_judged_on_raw_scores_not_shaped_rewards():
    f = GroupFilter(min_std=0.0, refill_limit=4.0, groups_per_step=2)
    assert f.drops(_group(0, [1, 1, 1, 1]), 0)  # all right
    assert f.drops(_group(1, [0, 0, 0, 0]), 0)  # all wrong
    assert not f.drops(_group(2, [1, 0, 0, 0]), 0)
    # All wrong, yet the shaped rewards differ (a format bonus, an overlong penalty): dropped.
    assert f.drops(_group(3, [0, 0, 0, 0], rewards=[0.1, 0.0, -0.2, 0.1]), 0)
    # An unscored attempt (error, timeout) counts as 0, as the reward table scores it.
    g = _group(4, [0.0, 0.0, 0.0], statuses=["wrong", "error", "timeout"])
    assert raw_scores(g).tolist() == [0, 0, 0] and f.drops(g, 0)
    # Partial credit: std of [0.5, 0.75] is 0.125, over a 0.1 threshold and under 0.2.
    assert not GroupFilter(0.1, 4.0, 2).drops(_group(5, [0.5, 0.75]), 0)
    assert GroupFilter(0.2, 4.0, 2).drops(_group(6, [0.5, 0.75]), 0)
    assert (f.dropped, f.forced, f.seen) == (4, 0, 5)


def test_refills_are_capped_per_step_and_the_rest_is_trained():
    f = GroupFilter(min_std=0.0, refill_limit=0.5, groups_per_step=2)  # 1 refill a step
    alike = lambda i: _group(i, [1, 1])  # noqa: E731
    assert f.drops(alike(0), steps_begun=0)
    assert not f.drops(alike(1), steps_begun=0)  # the step's budget is spent: trained
    assert f.drops(alike(2), steps_begun=1)  # the next step brings one more
    assert (f.dropped, f.forced) == (2, 1)
    rec = f.record([alike(0), alike(2)])
    assert rec["filter/dropped"] == 2 and rec["filter/dropped_total"] == 2
    assert rec["filter/forced_total"] == 1 and rec["filter/kept_frac"] == pytest.approx(1 / 3)
    assert rec["filter/dropped_raw_mean"] == 1.0


def test_metrics_keep_raw_and_shaped_rewards_apart():
    f = GroupFilter(0.0, 4.0, 2)
    g = _group(0, [0, 0], rewards=[0.1, -0.3])
    assert f.drops(g, 0)
    rec = f.record([g])
    assert rec["filter/dropped_raw_mean"] == 0.0
    assert rec["filter/dropped_shaped_mean"] == pytest.approx(-0.1)


def test_bad_filter_settings_are_refused_in_one_line():
    base = dict(seq_len=32, num_rows=2, max_sequences=4, max_sequence_len=16)
    with pytest.raises(ConfigError, match="filter_min_std=-0.1 must be >= 0"):
        BatchConfig(**base, filter_min_std=-0.1)
    with pytest.raises(ConfigError, match="filter_refill_limit=0"):
        BatchConfig(**base, filter_refill_limit=0)


def test_the_board_takes_kept_groups_in_start_order_and_waits_for_gaps():
    board, stop = ReadyBoard(), threading.Event()
    for g in (_group(0, [1, 1]), _group(2, [1, 0]), _group(3, [0, 1])):
        board.put(g)
    board._ready[0].dropped = True
    stop.set()  # with stop set, a take that would wait returns None at once
    assert board.take_kept(0, 2, stop) is None  # group 1 is still generating: wait for it
    board.put(_group(1, [0, 1]))
    kept, dropped, nxt = board.take_kept(0, 2, stop)
    assert [g.index for g in kept] == [1, 2] and [g.index for g in dropped] == [0]
    assert nxt == 3 and len(board) == 1


def simulate(max_lag, drop_p, *, steps=60, g=4, slots=24, seed=0):
    """Ticks a sampler and a trainer around the real Admission and ReadyBoard; each finished
    group is dropped with probability drop_p. Returns the lags of every trained token, the
    start indices each step trained, and the number of drops."""
    rng = np.random.default_rng(seed)
    admission, board = Admission(groups_per_step=g, max_lag=max_lag), ReadyBoard()
    stop = threading.Event()
    stop.set()  # takes never block: the simulation probes and moves on
    sampler_version, trainer_version, next_index, drops = 0, 0, 0, 0
    pending_publish, running, lags, trained = [], {}, [], []
    for tick in range(200_000):
        while pending_publish and pending_publish[0][0] <= tick:
            sampler_version = max(sampler_version, pending_publish.pop(0)[1])
        while len(running) < slots:
            index = admission.try_start(sampler_version)
            if index is None:
                break
            running[index] = [int(rng.pareto(1.5) * 3) + 1, []]
        for index in list(running):
            running[index][1].append(sampler_version)
            running[index][0] -= 1
            if running[index][0] == 0:
                versions = running.pop(index)[1]
                group = Group(index=index, problem=versions, prompt_ids=[])
                if rng.random() < drop_p:
                    group.dropped = True
                    admission.drop()
                    drops += 1
                board.put(group)
        taken = board.take_kept(next_index, g, stop)
        if taken is not None:
            kept, _, next_index = taken
            trained.append([k.index for k in kept])
            lags.extend(trainer_version - v for k in kept for v in k.problem)
            trainer_version += 1
            pending_publish.append((tick + 2, trainer_version))
            if trainer_version == steps:
                return np.array(lags), trained, drops
    raise AssertionError("simulation deadlocked")


@pytest.mark.parametrize("max_lag", [0, 1, 3])
@pytest.mark.parametrize("drop_p", [0.3, 0.7])
def test_with_drops_lag_stays_bounded_exactly_and_steps_train_in_start_order(max_lag, drop_p):
    lags, trained, drops = simulate(max_lag, drop_p, seed=max_lag)
    assert drops > 0 and lags.min() >= 0
    assert lags.max() == max_lag  # reached, never exceeded
    flat = [i for step in trained for i in step]
    assert all(len(step) == 4 for step in trained)  # every step full
    assert flat == sorted(flat) and len(set(flat)) == len(flat)  # start order, once each


def _train_records(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"kind": "train"' in line]


def test_a_run_drops_refills_and_resumes_with_its_drops(tmp_path):
    """The tiny preset's random policy scores most groups alike: steps still train 4 groups
    each, never a prompt twice, within the lag bound; the drops are counted; a resume from a
    checkpoint with drops pending goes on from them."""
    quiet = dict(log_every=0, eval_every=0, batch={"filter_groups": True})
    run = tmp_path / "run"
    cfg = presets.tiny(steps=4, checkpoint_every=2, **quiet)
    assert pipeline.run(cfg, str(run), echo=lambda *_: None)["steps"] == 4
    longer = presets.tiny(steps=6, checkpoint_every=2, **quiet)
    lines = []
    assert pipeline.run(longer, str(run), echo=lines.append)["steps"] == 6
    assert any(line.startswith("resumed from step 4") for line in lines)
    records = _train_records(run)
    assert [r["step"] for r in records] == list(range(6))
    prompts = [p for r in records for p in r["prompts"]]
    assert all(len(r["prompts"]) == 4 for r in records)
    assert len(set(prompts)) == len(prompts)  # no group trained twice, across the resume
    assert max(r["lag/token_max"] for r in records) <= records[0]["lag/bound"]
    assert records[-1]["filter/dropped_total"] > 0
    assert sum(r["filter/dropped"] for r in records) <= records[-1]["filter/dropped_total"]
    assert all(0 <= r["filter/kept_frac"] <= 1 for r in records)
    # Resumed: the totals went on from the checkpoint's, they did not restart at 0.
    assert records[4]["filter/dropped_total"] >= records[3]["filter/dropped_total"]


def test_filtering_off_by_default_trains_the_fixed_indices():
    cfg = presets.tiny()
    assert not cfg.batch.filter_groups
    assert GroupFilter.from_config(cfg.batch, 4) is None
