"""plan measure: the U(h) matmul recipe at tiny sizes, and the sampler/trainer probes."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from pipelinerl_jax.plan import engine_probe, layout, measure, model
from pipelinerl_jax.plan import utilisation as util
from pipelinerl_jax.plan.utilisation import PlanError


def test_padding_candidates_by_hand():
    assert measure.padding_candidates(1) == [1, 2, 4, 8, 16, 32, 64]
    assert measure.padding_candidates(100) == [100, 104, 112, 128]
    assert measure.padding_candidates(130, max_pad=64) == [130, 132, 136, 144, 160, 192]
    assert measure.padding_candidates(130, max_pad=4) == [130, 132]
    with pytest.raises(PlanError):
        measure.padding_candidates(0)


def test_known_peaks():
    assert measure.known_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert measure.known_peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756.0e12
    assert measure.known_peak_flops("cpu", "float32") is None


def test_matmul_utilisation_tiny():
    u = measure.matmul_utilisation(
        [1, 3], m=32, n=64, dtype="float32", max_pad=1, repeats=1, reference_size=64
    )
    curve = util.UtilisationCurve.from_dict(u)
    assert curve.batch_sizes == (1.0, 3.0)
    assert all(0 < v <= 1 for v in curve.values)
    for h, k, sec, v in zip(u["batch_sizes"], u["best_padded_batch"], u["seconds"], u["values"]):
        assert k in measure.padding_candidates(int(h), 1)
        # U = useful FLOPs of the unpadded product / time of the best padded one / peak.
        assert v == pytest.approx(2 * 32 * h * 64 / sec / u["peak_flops"])
    assert "no published peak" in u["peak_source"]
    given = measure.matmul_utilisation(
        [2], m=16, n=16, dtype="float32", repeats=1, max_pad=0, peak_flops=1e15
    )
    assert given["peak_source"] == "given" and given["values"][0] < 1e-3


def test_measure_cli_writes_a_loadable_profile(tmp_path):
    out = tmp_path / "p.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelinerl_jax.plan",
            "measure",
            f"--out={out}",
            "--batch_sizes=1,4",
            "--matmul_m=32",
            "--matmul_n=64",
            "--repeats=1",
            "--max_pad=0",
            "--peak_tflops=1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    prof = util.load_profile(out)
    assert prof["backend"] == "cpu"
    assert util.utilisation_from_profile(prof).batch_sizes == (1.0, 4.0)
    assert prof["utilisation"]["peak_flops"] == 1e12
    assert prof["utilisation"]["recipe"] == {
        "m": 32,
        "n": 64,
        "dtype": "float32",
        "max_pad": 0,
        "repeats": 1,
        "statistic": "min",
    }
    r = subprocess.run(
        [sys.executable, "-m", "pipelinerl_jax.plan", "measure", "--nomatmul", f"--out={out}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "nothing to do" in r.stderr


def test_hooks_time_plain_callables():
    calls = []
    lat = measure.measure_decode_latency(lambda b: lambda: calls.append(b), [1, 4], repeats=2)
    assert len(lat) == 2 and calls == [1, 1, 1, 4, 4, 4]  # one warm-up + two timed each
    assert measure.measure_train_throughput(lambda: None, 100, repeats=1) > 0


def test_engine_profile_tiny_model_feeds_the_planner():
    graphdef, params = engine_probe.tiny_model(num_hidden_layers=1)
    prof = engine_probe.engine_profile(
        graphdef,
        params,
        decode_batch_sizes=[2],
        context_len=8,
        chunk_steps=2,
        train_rows=2,
        train_seq_len=16,
        repeats=1,
        memory_bytes=2**22,
        source="tiny",
    )
    dec, tr = prof["decode"], prof["train"]
    assert dec["batch_sizes"] == [2] and dec["latency_s"][0] > 0
    # KV bound by hand: 4 MiB·0.9 minus the f32 weights over K+V of 8 tokens x 1 layer.
    per_seq = 2 * 1 * 2 * 16 * 4 * 8
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert dec["kv_max_batch"] == int((2**22 * 0.9 - param_bytes) // per_seq)
    assert tr["tokens_per_s_per_device"] > 0
    assert tr["packed_tokens_per_s"] == pytest.approx(tr["tokens_per_s_per_device"] * 16 / 8)
    json.dumps(prof)  # the profile is plain JSON
    dp = layout.DeviceProfile.from_measurements(
        decode_batch_sizes=dec["batch_sizes"],
        decode_latency_s=dec["latency_s"],
        train_tokens_per_s_per_device=tr["tokens_per_s_per_device"],
    )
    plan = layout.plan_layout(
        dp,
        layout.Workload(4, 4, model.LengthDistribution.uniform(8), 2),
        compare_conventional=False,
    )
    # Rates recomputed from the measurements, not from the plan's own fields: r_train =
    # (N - I) x train tokens/s per device, r_gen = I x H / decode latency at H (H = 2, the
    # one measured batch size).
    r_train = (4 - plan.gen_devices) * tr["tokens_per_s_per_device"]
    r_gen = plan.gen_devices * 2 / dec["latency_s"][0]
    assert plan.gen_batch == 2
    assert plan.r_train == pytest.approx(r_train) and plan.r_gen == pytest.approx(r_gen)
    assert plan.r == pytest.approx(min(r_gen, r_train))
    assert np.isfinite(plan.gen_idle) and np.isfinite(plan.train_idle)
