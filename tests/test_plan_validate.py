"""plan/validate.py: run shapes, observed lengths, predictions and a run's steady state by hand."""

import numpy as np
import pytest

from pipelinerl_jax.plan import model, validate
from pipelinerl_jax.plan.utilisation import PlanError


def _shape(**kw):
    base = dict(devices=2, gen_devices=1, num_slots=8, batch_size=8, max_lag=2, max_new_tokens=4)
    return validate.RunShape(**{**base, **kw})


def test_maxent_lengths_matches_the_mean_and_keeps_the_support():
    uniform = validate.maxent_lengths(4.5, 8)
    np.testing.assert_allclose(uniform.probs, np.full(8, 1 / 8), atol=1e-9)
    for mean in (1.3, 2.0, 6.3, 7.9):
        d = validate.maxent_lengths(mean, 8)
        assert d.mean_len == pytest.approx(mean, abs=1e-9)
        assert d.max_len == 8  # g_max needs L even when long completions are rare
        p = np.diff(d.probs)
        assert np.all(p > 0) if mean > 4.5 else np.all(p < 0)  # exponential tilt
    assert validate.maxent_lengths(1.0, 8).max_len == 8
    assert validate.maxent_lengths(8.0, 8).probs[-1] == pytest.approx(1.0)


@pytest.mark.parametrize("mean,max_len", [(0.5, 8), (8.5, 8), (1.0, 0)])
def test_maxent_lengths_bad_input(mean, max_len):
    with pytest.raises(PlanError, match="mean"):
        validate.maxent_lengths(mean, max_len)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(devices=2, gen_devices=2), "not a split"),
        (dict(devices=1, gen_devices=2), "not a split"),
        (dict(devices=3, gen_devices=2, num_slots=9), "multiple"),
        (dict(max_lag=-1), "max_lag"),
    ],
)
def test_run_shape_bad_input(kw, match):
    with pytest.raises(PlanError, match=match):
        _shape(**kw)


def test_two_device_prediction_by_hand():
    # H = 8 slots on I = 1 device at 100 tokens/s; the trainer packs B = 8 sequences of mean
    # length 2.5 (uniform 1..4) in 0.1 s: 200 tokens/s. Generation limits: r = 100 tokens/s,
    # 40 samples/s, the trainer idles half the time. g_max = ceil(8·1·4 / (2.5·8)) = 2.
    lengths = model.LengthDistribution.uniform(4)
    p = validate.predict(
        _shape(), gen_tokens_per_s_per_device=100.0, train_step_s_per_device=0.1, lengths=lengths
    )
    assert p["samples_per_s"] == pytest.approx(40.0)
    assert (p["sampler_busy"], p["trainer_busy"]) == (pytest.approx(1.0), pytest.approx(0.5))
    assert p["trainer_idle"] == pytest.approx(0.5) and p["sampler_idle"] == pytest.approx(0.0)
    assert (p["g_max"], p["lag"], p["bottleneck"]) == (2, 2, "sampler")
    # Three devices, two generating (16 slots, 8 each): 200 tokens/s both ways, both busy.
    p3 = validate.predict(
        _shape(devices=3, gen_devices=2, num_slots=16),
        gen_tokens_per_s_per_device=100.0,
        train_step_s_per_device=0.1,
        lengths=lengths,
    )
    assert p3["samples_per_s"] == pytest.approx(80.0)
    assert p3["sampler_busy"] == pytest.approx(1.0) and p3["trainer_busy"] == pytest.approx(1.0)
    assert p3["g_max"] == 4  # ceil(8·2·4 / (2.5·8))
    # A tighter bound than the split's g_max: admission caps the lag, no error.
    capped = validate.predict(
        _shape(max_lag=1),
        gen_tokens_per_s_per_device=100.0,
        train_step_s_per_device=0.1,
        lengths=lengths,
    )
    assert (capped["g_max"], capped["lag"]) == (2, 1)


def test_serial_prediction_by_hand_and_shared_mode():
    lengths = model.LengthDistribution.uniform(4)
    # 100 and 200 tokens/s taking turns: 1 / (1/100 + 1/200) = 66.7 tokens/s = 26.7 samples/s.
    s = validate.serial_prediction(
        _shape(), gen_tokens_per_s=100.0, train_step_s=0.1, lengths=lengths
    )
    assert s["samples_per_s"] == pytest.approx(200 / 3 / 2.5)
    assert s["sampler_busy"] == pytest.approx(2 / 3) and s["trainer_busy"] == pytest.approx(1 / 3)
    shared = validate.predict(
        _shape(devices=1),
        gen_tokens_per_s_per_device=100.0,
        train_step_s_per_device=0.1,
        lengths=lengths,
    )
    assert shared["samples_per_s"] == pytest.approx(s["samples_per_s"])
    with pytest.raises(PlanError, match="positive"):
        validate.serial_prediction(
            _shape(), gen_tokens_per_s=0.0, train_step_s=0.1, lengths=lengths
        )
    with pytest.raises(PlanError, match="positive"):
        validate.predict(
            _shape(), gen_tokens_per_s_per_device=1.0, train_step_s_per_device=-1, lengths=lengths
        )


def _synthetic_run(n=10, compile_s=10.0, period=0.5):
    """Records as the pipeline writes them for a known timeline: after `compile_s` (the
    sampler busy throughout, the trainer half of it), the sampler is busy 80% and the trainer
    30% of the time; record k's fractions are taken at e_k, and it is stamped one step later."""
    sampler = lambda e: compile_s + 0.8 * (e - compile_s)
    trainer = lambda e: compile_s / 2 + 0.3 * (e - compile_s)
    e = [compile_s + period * k for k in range(n)]
    records = []
    for k in range(n):
        records.append(
            {
                "kind": "train",
                "step": k,
                "time": e[k] + period,
                "sampler/busy_frac": sampler(e[k]) / e[k],
                "trainer/busy_frac": trainer(e[k]) / e[k],
                "trainer/wait_s": e[k] - trainer(e[k]),
                "completion/len_mean": 5.0 if k < n // 2 else 7.0,
                "completion/no_eos_frac": 0.25,
            }
        )
    wall = e[-1] + 0.2
    records.append(
        {
            "kind": "summary",
            "wall_s": wall,
            "steady_steps_per_s": 1 / period,
            "steps": n,
            "sampler/swaps": n - 1,
            "sampler/swap_latency_ms_median": 300.0,
            "steady_samples_per_s": 16 / period,
            "samples_per_s": 10.0,
            "lag/token_max": 2,
            "sampler/busy_frac": sampler(wall) / wall,
            "trainer/busy_frac": trainer(wall) / wall,
        }
    )
    return records


def test_steady_measurement_recovers_a_known_timeline():
    m = validate.steady_measurement(_synthetic_run())
    assert m["sampler_busy"] == pytest.approx(0.8)
    assert m["trainer_busy"] == pytest.approx(0.3)
    assert m["trainer_idle"] == pytest.approx(0.7)
    assert m["trainer_wait_frac"] == pytest.approx(0.7)
    assert m["mean_len"] == pytest.approx(7.0)  # the second half only
    assert (m["samples_per_s"], m["lag"], m["window_steps"]) == (32.0, 2, 5)
    # The whole-run fractions still carry the compile time: the steady ones must differ.
    assert m["busy_frac_whole_run"]["sampler"] > 0.8
    assert m["swaps_per_step"] == pytest.approx(0.9) and m["swap_latency_s_median"] == 0.3


def test_steady_measurement_bad_input():
    records = _synthetic_run()
    with pytest.raises(PlanError, match="summary"):
        validate.steady_measurement(records[:-1])
    with pytest.raises(PlanError, match="at least 4"):
        validate.steady_measurement(records[:3] + records[-1:])


def test_comparison_rows():
    pred = {"a": {q: 2.0 for q in validate.QUANTITIES}, "b": {q: 4.0 for q in validate.QUANTITIES}}
    meas = {q: 1.0 for q in validate.QUANTITIES}
    rows = validate.comparison_rows(pred, meas, label="N=2")
    assert [r["quantity"] for r in rows] == list(validate.QUANTITIES)
    assert all(r["measured/a"] == 0.5 and r["b"] == 4.0 and r["run"] == "N=2" for r in rows)
    assert validate.comparison_rows(pred, meas, reference="b")[0]["measured/b"] == 0.25
    with pytest.raises(PlanError, match="no predictions"):
        validate.comparison_rows({}, meas)


def test_swap_stall_fraction_by_hand():
    # 2 steps/s, one swap each, 0.3 s from publication to the end of the first chunk using it,
    # 0.05 s per ordinary chunk: 2 · 1 · 0.25 = half the time is spent waiting.
    assert validate.swap_stall_fraction(
        steps_per_s=2.0, swaps_per_step=1.0, swap_latency_s=0.3, chunk_s=0.05
    ) == pytest.approx(0.5)
    assert (
        validate.swap_stall_fraction(
            steps_per_s=2.0, swaps_per_step=1.0, swap_latency_s=0.01, chunk_s=0.05
        )
        == 0.0
    )
    assert (
        validate.swap_stall_fraction(
            steps_per_s=9.0, swaps_per_step=1.0, swap_latency_s=1.0, chunk_s=0.0
        )
        == 1.0
    )
    with pytest.raises(PlanError, match=">= 0"):
        validate.swap_stall_fraction(
            steps_per_s=-1.0, swaps_per_step=1.0, swap_latency_s=0.3, chunk_s=0.05
        )
