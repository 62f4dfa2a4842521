"""Appendix A formulas by hand (a two-device cluster), the paper's case study, search properties."""

import math

import numpy as np
import pytest

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.plan import layout, model, paper
from pipelinerl_jax.plan.utilisation import (
    PlanError,
    ProfileCoverageError,
    UtilisationCurve,
    roofline_curve,
)

# U(1) = 0.2, U(2) = 0.3: step times 5 and 20/3 flashes.
TWO = UtilisationCurve((1.0, 2.0), (0.2, 0.3), source="hand")


def test_flash_and_forward_flops():
    assert model.flash_seconds(2e9, 1e15) == pytest.approx(2e-6)
    assert model.forward_flops_per_token(7) == 14.0
    with pytest.raises(PlanError):
        model.flash_seconds(0, 1e15)


def test_curve_interpolates_step_time_and_refuses_to_extrapolate():
    assert TWO.rate([1.0, 2.0]) == pytest.approx([0.2, 0.3])
    # Midway the step time is the mean of 5 and 20/3.
    assert TWO.step_time(1.5) == pytest.approx((5 + 20 / 3) / 2)
    assert TWO(1.5) == pytest.approx(1.5 / ((5 + 20 / 3) / 2))
    # Below the first point a step costs as much as at h=1: rate proportional to h.
    assert TWO.step_time(0.25) == pytest.approx(5.0)
    assert TWO(0.5) == pytest.approx(0.1)
    with pytest.raises(ProfileCoverageError, match="up to 2"):
        TWO(2.5)
    assert issubclass(ProfileCoverageError, ConfigError)


@pytest.mark.parametrize(
    "bad",
    [
        dict(batch_sizes=(2.0, 1.0), values=(0.1, 0.2)),
        dict(batch_sizes=(1.0,), values=(0.0,)),
        dict(batch_sizes=(1.0, 2.0), values=(0.1,)),
        dict(batch_sizes=(1.0,), values=(0.1,), unit="furlongs"),
    ],
)
def test_curve_bad_input(bad):
    with pytest.raises(PlanError):
        UtilisationCurve(**bad)


def test_decode_latency_curve_and_truncation():
    c = UtilisationCurve.from_decode_latency([1, 4, 8], [0.01, 0.012, 0.016])
    assert c.rate([1, 4, 8]) == pytest.approx([100.0, 4 / 0.012, 500.0])
    assert c.step_time(6) == pytest.approx(0.014)
    assert c.truncated(5).batch_sizes == (1.0, 4.0)
    with pytest.raises(PlanError, match="smallest measured is 1"):
        c.truncated(0.5)


def test_length_distributions():
    u = model.LengthDistribution.uniform(4)
    assert u.max_len == 4 and u.mean_len == pytest.approx(2.5)
    assert u.survival() == pytest.approx([1.0, 0.75, 0.5, 0.25])
    e = model.LengthDistribution.from_lengths([1, 3, 3, 3])
    assert e.max_len == 3 and e.mean_len == pytest.approx(2.5)
    assert e.survival() == pytest.approx([1.0, 0.75, 0.75])
    h = model.LengthDistribution.from_histogram({"2": 1, 5: 3})
    assert h.max_len == 5 and h.mean_len == pytest.approx((2 + 15) / 4)
    for bad in (
        lambda: model.LengthDistribution.uniform(0),
        lambda: model.LengthDistribution.from_lengths([]),
        lambda: model.LengthDistribution.from_lengths([0, 2]),
        lambda: model.LengthDistribution.from_histogram({}),
    ):
        with pytest.raises(PlanError):
            bad()


def test_active_sequences_sum_to_round_tokens():
    rng = np.random.default_rng(0)
    dist = model.LengthDistribution.from_lengths(rng.integers(1, 50, size=200))
    h = model.active_sequences(dist, 96)
    assert h[0] == pytest.approx(96)
    assert h.sum() == pytest.approx(96 * dist.mean_len)  # K = S·L̄


def test_two_device_cluster_by_hand():
    dist = model.LengthDistribution.from_lengths([1, 3])  # L = 3, L̄ = 2
    # Conventional, B = 2, G = 1: h(l) = 2, 1, 1 -> per device 1, 0.5, 0.5 -> 5 flashes each.
    t = model.conventional_gen_time(TWO, dist, 2, 2)
    assert t == pytest.approx(15.0)
    r_gen = model.conventional_gen_rate(TWO, dist, 2, 2)
    assert r_gen == pytest.approx(4 / 15)  # K = 4 tokens
    r_train = model.train_rate(2, 2.0)
    assert r_train == 1.0
    assert model.conventional_rate(r_gen, r_train) == pytest.approx(4 / 19)
    assert model.conventional_max_lag(1) == 0
    # G = 2 (S = 4): per device 2, 1, 1 -> 20/3 + 5 + 5 flashes for 8 tokens.
    assert model.conventional_gen_rate(TWO, dist, 2, 4) == pytest.approx(8 / (20 / 3 + 10))
    # PipelineRL, I = 1, B = 2, tau = 2.
    assert model.pipeline_gen_rate(TWO, 2, 1) == pytest.approx(0.3)
    assert model.train_rate(1, 2.0) == 0.5
    assert model.pipeline_rate(0.3, 0.5) == pytest.approx(0.3)
    assert int(model.pipeline_max_lag(2, 1, dist, 2)) == 2  # ceil(2·1·3/(2·2)) = ceil(1.5)
    assert int(model.pipeline_max_lag(1, 1, dist, 2)) == 1  # ceil(0.75)
    grid = model.pipeline_grid(TWO, dist, num_devices=2, batch_size=2, tau=2.0)
    assert grid.gen_batches.tolist() == [1.0, 2.0] and grid.gen_devices.tolist() == [1]
    assert grid.r_pipe_HxI[:, 0] == pytest.approx([0.2, 0.3])
    c1 = model.best_pipeline(grid, 1)
    assert (c1.gen_batch, c1.gen_devices, c1.max_lag) == (1.0, 1, 1)
    c2 = model.best_pipeline(grid, 5)
    assert (c2.gen_batch, c2.r_pipe, c2.max_lag) == (2.0, pytest.approx(0.3), 2)
    with pytest.raises(PlanError, match="smallest max_lag any split reaches is 1"):
        model.best_pipeline(grid, 0)


def test_integral_lag_is_not_rounded_up():
    dist = model.LengthDistribution.uniform(1)  # L = L̄ = 1
    assert int(model.pipeline_max_lag(3, 2, dist, 3)) == 2  # exactly 6/3


def test_conventional_memory_cap_runs_at_the_bound_rate():
    dist = model.LengthDistribution.from_lengths([2, 2])
    # 2 devices, S = 8: 4 per device both steps; cap 2 -> each step costs 4 / U(2) flashes.
    t = model.conventional_gen_time(TWO, dist, 2, 8, max_batch=2)
    assert t == pytest.approx(2 * 4 / 0.3)
    with pytest.raises(ProfileCoverageError, match="needs per-device batch 4"):
        model.conventional_gen_time(TWO, dist, 2, 8)


def test_linear_utilisation_closed_form():
    # With U(x) = c·x every step costs 1/c flashes, so r_gen = c·S·L̄/L exactly (eq. 13).
    c = paper.U_H / paper.H
    curve = UtilisationCurve(tuple(range(1, 257)), tuple(c * h for h in range(1, 257)))
    dist = model.LengthDistribution.uniform(8192)
    s = 128 * 133
    expect = c * s * dist.mean_len / dist.max_len
    assert model.conventional_gen_rate(curve, dist, 128, s) == pytest.approx(expect, rel=1e-12)


def test_paper_case_study_values():
    cs = paper.case_study()
    assert round(cs["r_pipe_gen"], 1) == 16.9
    assert round(cs["r_pipe_train"], 2) == 17.08
    assert round(cs["r_pipe"], 1) == 16.9
    assert round(cs["r_conv_train"], 2) == 26.02
    assert cs["r_conv_gen"] == 18.3  # given: the paper never published its U(h) table
    assert round(cs["r_conv"], 1) == 10.7
    assert round(cs["speedup"], 2) == 1.57
    assert cs["g_max"] in (132, 133)
    assert cs["conventional_steps_per_round"] == cs["g_max"] + 1
    assert cs["g_max_b2048"] == 9  # the paper's "≈ 8" is 8.25 before rounding up
    # g_max does not depend on L once L >= 132 (L/L̄ = 2L/(L+1)).
    assert paper.case_study(max_len=1000)["g_max"] == 132
    # The derived stand-in curve lands within 5% of the published r_conv_gen.
    assert cs["roofline_stand_in"]["r_conv_gen"] == pytest.approx(18.3, rel=0.05)


def test_search_on_stand_in_curve_finds_the_papers_configuration():
    prof = layout.DeviceProfile(paper.h100_roofline_curve(), paper.TAU)
    work = layout.Workload(128, 128, model.LengthDistribution.uniform(paper.MAX_LEN), 132)
    plan = layout.plan_layout(prof, work)
    assert (plan.gen_batch, plan.gen_devices, plan.lag) == (192.0, 44, 132)
    assert plan.r == pytest.approx(16.9)
    assert plan.speedup > 1.5


def test_roofline_curve_by_hand():
    c = roofline_curve([1, 10**6], peak_flops=100.0, bandwidth=1.0, m=2, n=2, bytes_per_element=1)
    # h=1: 8 FLOPs over 2+2+4 bytes -> intensity 1 -> U = 1·1/100; h -> inf: intensity -> 2.
    assert c.values[0] == pytest.approx(0.01)
    assert c.values[1] == pytest.approx(0.02, rel=1e-5)
    big = roofline_curve([10**6], peak_flops=100.0, bandwidth=1.0, m=1000, n=1000, efficiency=0.5)
    assert big.values[0] == pytest.approx(0.5)  # compute-bound: clipped at 1, times efficiency


@pytest.mark.parametrize("seed", range(6))
def test_best_rate_never_decreases_as_lag_loosens(seed):
    rng = np.random.default_rng(seed)
    hs = np.unique(rng.integers(1, 64, size=8)).astype(float)
    curve = UtilisationCurve(tuple(hs), tuple(rng.uniform(0.05, 0.9, size=hs.size)))
    dist = model.LengthDistribution.from_lengths(rng.integers(1, 40, size=30))
    n, b = int(rng.integers(2, 12)), int(rng.integers(1, 32))
    grid = model.pipeline_grid(
        curve, dist, num_devices=n, batch_size=b, tau=float(rng.uniform(0.5, 20))
    )
    lags = np.arange(0, int(grid.lag_HxI.max()) + 3)
    best = model.best_rate_by_lag(grid, lags)
    finite = best[~np.isnan(best)]
    assert np.all(np.diff(finite) >= 0)
    assert np.isnan(best[: np.argmax(~np.isnan(best))]).all()  # infeasible only at the start
    for g, r in zip(lags, best):  # the sort/cummax agrees with the direct argmax
        if np.isnan(r):
            with pytest.raises(PlanError):
                model.best_pipeline(grid, int(g))
        else:
            choice = model.best_pipeline(grid, int(g))
            assert choice.r_pipe == pytest.approx(r) and choice.max_lag <= g


def test_pipeline_grid_bad_input():
    dist = model.LengthDistribution.uniform(8)
    with pytest.raises(PlanError, match="at least 2 devices"):
        model.pipeline_grid(TWO, dist, num_devices=1, batch_size=4, tau=1.0)
    with pytest.raises(PlanError, match="--batch=0"):
        model.pipeline_grid(TWO, dist, num_devices=4, batch_size=0, tau=1.0)
    with pytest.raises(PlanError, match="tau"):
        model.pipeline_grid(TWO, dist, num_devices=4, batch_size=4, tau=0.0)
    assert math.isnan(
        model.best_rate_by_lag(
            model.pipeline_grid(TWO, dist, num_devices=4, batch_size=4, tau=1.0), [0]
        )[0]
    )
