"""Admission control bounds lag exactly: a randomized event simulation of sampler and trainer."""

import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline.admission import Admission


def simulate(admission: Admission, *, steps: int, slots: int, seed: int, publish_delay: int):
    """Ticks a sampler with `slots` concurrent groups and a trainer that needs one tick per step.

    Each tick every running group emits one token tagged with the sampler's version; groups
    last a random number of ticks (heavy-tailed, so slow groups get overtaken). Returns the
    lags of all trained tokens and the versions seen per conventional round.
    """
    rng = np.random.default_rng(seed)
    sampler_version, trainer_version = 0, 0
    pending_publish = []  # (tick when it lands, version)
    running = {}  # index -> [remaining ticks, token versions]
    finished = {}
    lags = []
    round_versions = {}
    for tick in range(100_000):
        while pending_publish and pending_publish[0][0] <= tick:
            _, version = pending_publish.pop(0)
            sampler_version = max(sampler_version, version)
        while len(running) < slots:
            index = admission.try_start(sampler_version)
            if index is None:
                break
            running[index] = [int(rng.pareto(1.5) * 3) + 1, []]
        for index in list(running):
            remaining, versions = running[index]
            versions.append(sampler_version)
            running[index][0] -= 1
            if running[index][0] == 0:
                finished[index] = running.pop(index)[1]
        wanted = admission.step_indices(trainer_version)
        if all(i in finished for i in wanted):
            for i in wanted:
                versions = finished.pop(i)
                lags.extend(trainer_version - v for v in versions)
                round_versions.setdefault(
                    i // (admission.groups_per_step * admission.round_steps), set()
                ).update(versions)
            trainer_version += 1
            if admission.publishes(trainer_version):
                pending_publish.append((tick + publish_delay, trainer_version))
            if trainer_version == steps:
                return np.array(lags), round_versions
    raise AssertionError("simulation deadlocked")


@pytest.mark.parametrize("max_lag", [0, 1, 3, 7])
@pytest.mark.parametrize("seed", [0, 1])
def test_pipeline_lag_never_exceeds_max_lag(max_lag, seed):
    admission = Admission(groups_per_step=4, max_lag=max_lag)
    lags, _ = simulate(admission, steps=60, slots=24, seed=seed, publish_delay=2)
    assert lags.min() >= 0
    # The bound is reached exactly (24 slots, 4 groups a step: the sampler can always run
    # max_lag steps ahead): an admission that held back one step too early fails here, as
    # does one that lets a token through one step too stale.
    assert lags.max() == max_lag


@pytest.mark.parametrize("round_steps", [1, 2, 4])
def test_conventional_rounds_have_one_version_and_lag_below_round(round_steps):
    admission = Admission(
        groups_per_step=3, max_lag=0, mode="conventional", round_steps=round_steps
    )
    lags, rounds = simulate(admission, steps=8 * round_steps, slots=64, seed=3, publish_delay=1)
    assert lags.max() == round_steps - 1
    assert all(len(versions) == 1 for versions in rounds.values())
    assert [next(iter(rounds[r])) for r in sorted(rounds)] == [
        r * round_steps for r in sorted(rounds)
    ]


def test_capacity_and_step_indices():
    admission = Admission(groups_per_step=2, max_lag=1)
    assert admission.capacity(0) == 4
    assert [admission.try_start(0) for _ in range(5)] == [0, 1, 2, 3, None]
    assert admission.available(1) == 2
    assert list(admission.step_indices(3)) == [6, 7]
    assert admission.lag_bound() == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(groups_per_step=0, max_lag=1), "groups_per_step"),
        (dict(groups_per_step=1, max_lag=-1), "max_lag"),
        (dict(groups_per_step=1, max_lag=1, mode="async"), "unknown mode"),
        (dict(groups_per_step=1, max_lag=1, mode="conventional", round_steps=0), "round_steps"),
    ],
)
def test_bad_settings_fail_with_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        Admission(**kwargs)
    assert "\n" not in str(info.value)
