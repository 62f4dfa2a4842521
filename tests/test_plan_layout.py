"""The talk's form: measured decode latency + train tokens/s -> split, batch, lag, idle."""

import numpy as np
import pytest

from pipelinerl_jax.plan import layout, model
from pipelinerl_jax.plan import utilisation as util
from pipelinerl_jax.plan.utilisation import PlanError, ProfileCoverageError

# Decode latency grows slowly with batch (memory-bound): 10 ms at 1, 12 ms at 4, 16 ms at 8.
PROF = layout.DeviceProfile.from_measurements(
    decode_batch_sizes=[1, 4, 8],
    decode_latency_s=[0.010, 0.012, 0.016],
    train_tokens_per_s_per_device=300.0,
)
DIST = model.LengthDistribution.uniform(9)  # L = 9, L̄ = 5


def test_kv_cache_bound_by_hand():
    # 2 (K,V) · 2 layers · 1 head · 4 dims · 2 bytes · 10 tokens = 320 bytes per sequence.
    n = layout.kv_cache_max_batch(
        memory_bytes=10_000,
        param_bytes=1_000,
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        context_len=10,
        reserve_fraction=0.1,
    )
    assert n == (9_000 - 1_000) // 320
    with pytest.raises(PlanError, match="less than one"):
        layout.kv_cache_max_batch(
            memory_bytes=1_000,
            param_bytes=900,
            num_layers=2,
            num_kv_heads=1,
            head_dim=4,
            context_len=10,
        )


def test_two_device_plan_by_hand():
    work = layout.Workload(devices=2, batch_size=8, lengths=DIST, max_lag=1)
    plan = layout.plan_layout(PROF, work)
    # I = 1, the lag bound allows H with ceil(H·9/(5·8)) <= 1, i.e. H <= 4; at H = 4 the
    # generator makes 4/0.012 = 333 tokens/s, the trainer eats 300: the trainer is the limit.
    assert (plan.gen_devices, plan.train_devices) == (1, 1)
    assert plan.r_train == pytest.approx(300.0)
    assert plan.r == pytest.approx(300.0)
    # The tie-break picks the smallest H·I reaching 300 tokens/s: H = 4 (H = 3 gives 3/0.01133).
    assert plan.gen_batch == 4.0
    assert plan.r_gen == pytest.approx(4 / 0.012)
    assert plan.lag == 1
    assert plan.gen_idle == pytest.approx(1 - 300 / (4 / 0.012))
    assert plan.train_idle == pytest.approx(0.0)
    assert plan.samples_rate == pytest.approx(300 / 5)
    assert plan.steps_rate == pytest.approx(300 / 40)
    # Conventional at G = 2: 16 sequences over 2 devices, 8 each at step 1.
    c = plan.conventional
    assert c["steps_per_round"] == 2 and c["max_lag"] == 1 and c["peak_batch"] == 8
    assert c["r_train"] == pytest.approx(600.0)
    x = model.active_sequences(DIST, 16) / 2
    t = np.interp(x, [1, 4, 8], [0.010, 0.012, 0.016]).sum()
    assert c["r_gen"] == pytest.approx(16 * 5 / t)
    assert c["r"] == pytest.approx(1 / (1 / c["r_gen"] + 1 / 600))
    assert plan.speedup == pytest.approx(300 / c["r"])
    assert c["gen_time_fraction"] + c["train_time_fraction"] == pytest.approx(1.0)
    text = layout.format_plan(plan, work)
    assert "tokens/s" in text and "speedup over Conventional" in text


def test_kv_bound_limits_batch_and_fixed_choices():
    prof = layout.DeviceProfile(PROF.gen_curve, PROF.tau, max_gen_batch=2)
    work = layout.Workload(devices=4, batch_size=8, lengths=DIST, max_lag=10)
    plan = layout.plan_layout(prof, work)  # Conventional is capped at 2 per device too
    assert plan.gen_batch <= 2
    # Every step of the round holds > 2 per device, so all run at rate(2) = 2/0.010667 = 187.5.
    assert plan.conventional["r_gen"] == pytest.approx(4 * 187.5)
    fixed = layout.plan_layout(PROF, work, gen_devices=2, gen_batch=8, compare_conventional=False)
    assert (fixed.gen_devices, fixed.gen_batch) == (2, 8.0)
    assert fixed.r_gen == pytest.approx(2 * 8 / 0.016)
    with pytest.raises(PlanError, match=r"must be in 1\.\.3"):
        layout.plan_layout(PROF, work, gen_devices=4)
    with pytest.raises(PlanError, match="KV-cache bound"):
        layout.plan_layout(prof, work, gen_batch=4)
    with pytest.raises(PlanError, match="up to 8"):
        layout.plan_layout(PROF, work, gen_batch=16)
    with pytest.raises(PlanError, match=">= 0"):
        layout.plan_layout(PROF, layout.Workload(4, 8, DIST, -1))


def test_lag_bound_nobody_meets_names_the_smallest_that_works():
    work = layout.Workload(devices=4, batch_size=1, lengths=DIST, max_lag=1)
    # Smallest g_max: H = I = 1 -> ceil(9/5) = 2.
    with pytest.raises(PlanError, match=">= 2"):
        layout.plan_layout(PROF, work)


def test_conventional_needs_profile_coverage():
    work = layout.Workload(devices=2, batch_size=8, lengths=DIST, max_lag=2)  # 12 per device
    with pytest.raises(ProfileCoverageError, match="needs per-device batch 12"):
        layout.plan_layout(PROF, work)
    assert layout.conventional_lag_covered(PROF, work) == 1
    plan = layout.plan_layout(PROF, work, compare_conventional=False)
    assert plan.conventional == {} and np.isnan(plan.speedup)


def test_lag_sweep_matches_single_plans():
    work = layout.Workload(devices=4, batch_size=8, lengths=DIST, max_lag=3)
    sweep = layout.lag_sweep(PROF, work, [1, 2, 3])
    for g, p, c in zip(sweep["max_lag"], sweep["pipeline"], sweep["conventional"]):
        plan = layout.plan_layout(PROF, layout.Workload(4, 8, DIST, int(g)))
        assert plan.r == pytest.approx(p) and plan.conventional["r"] == pytest.approx(c)
    assert np.all(np.diff(sweep["pipeline"]) >= 0)


def test_profile_round_trip_and_bad_files(tmp_path):
    prof = {
        "utilisation": util.UtilisationCurve((1.0, 8.0), (0.1, 0.5)).to_dict(),
        "decode": {"batch_sizes": [1, 8], "latency_s": [0.01, 0.02]},
    }
    path = util.save_profile(prof, tmp_path / "p.json")
    loaded = util.load_profile(path)
    assert util.utilisation_from_profile(loaded).values == (0.1, 0.5)
    assert util.decode_curve_from_profile(loaded).rate(8) == pytest.approx(400.0)
    with pytest.raises(PlanError, match="no such file"):
        util.load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        util.load_profile(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(PlanError, match="not a planner profile"):
        util.load_profile(tmp_path / "other.json")
    with pytest.raises(PlanError, match="no 'decode' section"):
        util.decode_curve_from_profile({"utilisation": {}})
    with pytest.raises(PlanError, match="'batch_sizes' and 'values'"):
        util.utilisation_from_profile({"utilisation": {"values": [1]}})
