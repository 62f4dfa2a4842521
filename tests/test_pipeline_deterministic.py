"""Deterministic pipeline mode (config.deterministic): the same seed gives the same run, bit
for bit, uninterrupted or killed with -9 and resumed.

Pipeline mode swaps weights whenever the trainer publishes them, so two runs differ in which
tokens each version sampled. With config.deterministic the sampler's swaps, admissions,
scoring and checkpoint drains are fixed by counts (pipeline/determinism.py): every step's
batch (replay/batch_crc: tokens, behaviour logprobs, versions, advantages), every loss and
the final parameters must be equal.
"""

import random

import jax
import numpy as np
import pytest

from pipelinerl_jax import presets
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.export import load_model
from pipelinerl_jax.pipeline.determinism import SwapSchedule, derived_swap_chunks
from pipelinerl_jax.pipeline.weights import Publisher
from tests.test_pipeline_resume import kill_after_checkpoint, launch, train_records

STEPS = 50
LATE_REWARD = "tests.test_pipeline_deterministic:late_reward"
# Replay-relevant fields of a step's record (timings and queue sizes are not).
REPLAYED = (
    "replay/batch_crc",
    "prompts",
    "loss",
    "reward/mean",
    "completion/len_mean",
    "lag/token_mean",
    "lag/token_max",
    "seq/mixed_version_frac",
    "version/min",
)


def late_reward(completion: str, problem):
    """The task's reward, 5 ms late for half the problems (by a hash of their uid): rewards
    then come back out of order, and two default-mode runs of this file's config differed in
    46 of 50 losses (47 with filter_groups; EPYC, 2 cores); deterministic runs must not."""
    import time
    import zlib

    from pipelinerl_jax.rewards.tables import task_reward

    if zlib.crc32(problem.uid.encode()) % 2 == 0:
        time.sleep(0.005)
    return task_reward(completion, problem)


def replayed(records) -> dict:
    return {r["step"]: {k: r.get(k) for k in REPLAYED} for r in records}


# --- the schedule, by hand --------------------------------------------------------------


def test_schedule_counts_kept_groups_in_start_order_and_dates_each_step():
    s = SwapSchedule(
        swap_chunks=2, groups_per_step=2, drain_every=0, steps=10, start_step=0, next_index=0
    )
    s.scored(1, True)  # group 0 still generating: nothing counts yet
    assert not s.step_ready(0)
    s.ran_chunk()
    s.scored(0, True)  # 0 and 1 kept: step 0's data complete after chunk 1
    assert s.step_ready(0) and not s.step_ready(1)
    assert not s.swap_due(0)  # due swap_chunks after its data was complete
    s.ran_chunk()
    assert not s.swap_due(0)
    s.ran_chunk()
    assert s.swap_due(0) and not s.swap_due(1)
    s.scored(2, False)  # a dropped group does not count towards a step
    s.scored(3, True)
    assert not s.step_ready(1)
    s.scored(4, True)
    assert s.step_ready(1)


def test_schedule_drains_before_each_checkpoint_but_the_last():
    s = SwapSchedule(
        swap_chunks=1, groups_per_step=4, drain_every=3, steps=9, start_step=0, next_index=0
    )
    assert s.barrier() == 3 and s.admission_limit() == 12
    for _ in range(5):
        s.ran_chunk()
    s.drained(3)
    assert s.chunk == 0 and s.barrier() == 6 and s.admission_limit() == 24
    s.drained(6)
    assert s.barrier() is None and s.admission_limit() is None  # step 9 is the end
    # A resumed run starts past its checkpoint, with the steps before it counted as kept.
    r = SwapSchedule(
        swap_chunks=1, groups_per_step=4, drain_every=3, steps=9, start_step=3, next_index=13
    )
    assert r.barrier() == 6 and r.step_ready(2) and not r.step_ready(3)


def test_derived_swap_chunks_grows_with_the_step_and_shrinks_with_the_chunk():
    cfg = presets.demo(deterministic=True)
    k = derived_swap_chunks(cfg)
    assert k >= 1
    assert derived_swap_chunks(presets.demo(deterministic=True, batch_size=128)) > k
    more_slots = presets.demo(deterministic=True, sampler=dict(num_slots=256))
    assert derived_swap_chunks(more_slots) <= k


def test_publisher_keeps_every_version_until_taken_in_order():
    pub = Publisher(lambda p: p, keep_all=True)
    for v in (1, 2, 3):
        pub.publish({"w": np.full(2, v)}, v)
    assert pub.take_version(4) is None
    assert pub.take_version(2).version == 2  # 1 is dropped with it: older than taken
    assert pub.take_version(1) is None
    assert pub.take_version(3).params["w"][0] == 3
    assert pub.skipped == 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(swap_chunks=3), "only applies with config.deterministic=true"),
        (dict(deterministic=True, swap_chunks=-1), "swap_chunks=-1 must be >= 0"),
        (dict(deterministic=True, mode="conventional"), "applies to mode=pipeline"),
        (dict(deterministic=True, env=dict(name="guess")), "an environment answers"),
        (dict(deterministic="yes"), "must be true or false"),
    ],
)
def test_bad_deterministic_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        presets.tiny(**overrides)
    assert "\n" not in str(e.value)


# --- whole runs ----------------------------------------------------------------------------


DET_FLAGS = [
    "--config=configs/tiny.py",
    "--config.deterministic=true",
    "--config.max_lag=2",
    f"--config.steps={STEPS}",
    "--config.checkpoint_every=10",
    "--config.checkpoint_keep=8",
    "--config.eval_every=0",
    f"--config.reward.fn={LATE_REWARD}",
    # Dynamic sampling on: drops, refills and the filter's cap must land identically too.
    "--config.batch.filter_groups=true",
]


def test_two_runs_agree_bit_for_bit_and_so_does_a_kill_9_and_resume(tmp_path):
    """Run `full` uninterrupted; run `killed` is the same launch, killed with -9 after a
    checkpoint and relaunched: its steps before the kill are a second run of the same seed,
    the steps after it a resumed run. Every step and the final parameters must agree."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    # The launches use the persistent compilation cache (config.compile_cache "auto", as the
    # suite's other launches do): the later ones load what the first compiled, and must
    # replay it all the same.
    flags = DET_FLAGS
    ref = launch(full, flags=flags)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_records = train_records(full)
    # Stale tokens trained, and sequences that span a swap (the point of pipeline mode).
    assert max(r["lag/token_max"] for r in ref_records) == 2
    assert np.mean([r["seq/mixed_version_frac"] for r in ref_records]) > 0.2
    assert ref_records[-1]["sampler/swaps"] >= STEPS // 2
    assert sum(r.get("filter/dropped", 0) for r in ref_records) > 0

    kill_after = random.Random(20261127).choice([15, 25, 35])  # past a checkpoint
    kill_after_checkpoint(launch(killed, wait=False, flags=flags), killed, kill_after)
    resumed = launch(killed, flags=flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step" in resumed.stdout
    context = f"killed after {kill_after} logged steps (random.Random(20261127))"

    ref_steps = replayed(ref_records)
    # The killed run logged some steps that the resumed one re-did: the last record wins.
    steps = replayed(train_records(killed))
    assert sorted(steps) == list(range(STEPS)), context
    for step in range(STEPS):
        assert steps[step] == ref_steps[step], (context, step)
    _, _, _, params_full = load_model(full)
    _, _, _, params_killed = load_model(killed)
    for x, y in zip(jax.tree.leaves(params_full), jax.tree.leaves(params_killed)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=context)


def test_xla_flag_is_added_once_and_keeps_the_users():
    from pipelinerl_jax.pipeline.determinism import GPU_XLA_FLAG, set_xla_flags

    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    set_xla_flags(env)
    set_xla_flags(env)
    assert env["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {GPU_XLA_FLAG}"
    env = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=false"}  # the user's choice wins
    set_xla_flags(env)
    assert env["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=false"


def test_multi_process_deterministic_is_refused_in_one_line(tmp_path):
    res = launch(
        tmp_path / "w",
        "--spawn_local=3",
        flags=["--config=configs/tiny.py", "--config.deterministic=true"],
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith("config error: config.deterministic")
    assert not (tmp_path / "w" / "metrics.jsonl").exists()


def test_a_deterministic_interrupt_saves_nothing_mid_flight():
    from pipelinerl_jax.pipeline.checkpointing import interrupted

    class Ckpt:
        last_saved = 10
        cfg = presets.tiny(deterministic=True, checkpoint_every=10)

        def save(self, coord):  # pragma: no cover - must not be called
            raise AssertionError("saved mid-flight")

    class Stream:
        def __next__(self):  # pragma: no cover - never drawn
            raise StopIteration

        def get_state(self):
            return {}

        def set_state(self, state):
            pass

    class Coord:
        step, cfg, stream = 19, Ckpt.cfg, Stream()

        def stopped(self):
            return True

    said = []
    interrupted(Coord(), Ckpt(), said.append)
    assert "saves only at drained checkpoints" in said[0]
    assert "resumes from step 10" in said[0]
