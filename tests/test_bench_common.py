"""bench helpers: alternating-round medians (common.py), dots read from HLO (train_step_xla)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402


def test_alternating_medians_interleaves_rounds_and_takes_each_median(monkeypatch):
    calls = []
    # A fake clock: each call of a fn advances it by that fn's next duration (binary
    # fractions, so the differences are exact).
    durations = {
        "ours": iter([0.5, 3.0, 1.0, 2.0, 0.25, 9.0, 7.0, 1.0, 6.0, 4.0]),
        "peer": iter([7.0, 4.0, 6.0, 5.0, 8.0, 0.125, 3.0, 1.0, 0.5, 2.0]),
    }
    clock = [0.0]
    monkeypatch.setattr("time.perf_counter", lambda: clock[0])

    def make(name):
        def fn():
            calls.append(name)
            clock[0] += next(durations[name])

        return fn

    out = common.alternating_medians(
        {"ours": make("ours"), "peer": make("peer")}, repeats=5, warmup=1
    )
    # 5 rounds; in each, every fn gets one untimed warm-up call right before its timed one.
    assert calls == ["ours", "ours", "peer", "peer"] * 5
    assert out["ours"] == (3.0, [3.0, 2.0, 9.0, 1.0, 4.0])  # its 2nd, 4th, ... durations
    assert out["peer"] == (2.0, [4.0, 5.0, 0.125, 1.0, 2.0])


def test_dot_inventory_names_each_dot_backend_and_dtypes():
    """bench/train_step_xla.py reads dots out of optimized HLO: a bf16 matmul with f32
    accumulation and an f32 one, each counted with its operand dtypes and fusion kind."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench import train_step_xla

    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((64, 96), (96, 32)))

    def f(a, b):
        low = jnp.dot(
            a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32
        )
        return low + jnp.dot(a, b)

    hlo = jax.jit(f).lower(a, b).compile().as_text()
    dots = train_step_xla.dot_inventory(hlo)
    assert sum(d["count"] for d in dots) == 2
    assert sorted(d["operands"] for d in dots) == ["bf16 x bf16", "f32 x f32"]
    assert all(
        d["result"] == "f32[64,32]" and d["contraction"] == "contracts {1} x {0}" for d in dots
    )
    # Each is named by the fusion that calls it, never by the fused computation it sits in
    # (a fused computation is printed before its caller).
    assert not any(d["backend"].startswith("unfused (fused_computation") for d in dots), dots


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--sides=default,mkl"], "--sides: unknown ['mkl']"),
        (["--dtypes=float16"], "--dtypes: unknown ['float16']"),
        (["--model_dir=/nonexistent"], "no model at /nonexistent: run `make real-model` first"),
    ],
)
def test_train_step_xla_refuses_bad_flags_in_one_line(argv, says, capsys, tmp_path):
    from bench import train_step_xla

    if not any(a.startswith("--model_dir") for a in argv):
        (tmp_path / "config.json").write_text("{}")  # a model dir that passes the check
        argv = [*argv, f"--model_dir={tmp_path}"]
    try:
        code = train_step_xla.main(argv)
    except SystemExit as e:  # common.require_model exits before anything runs
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_bench_gemm_refuses_an_unknown_weight_gradient_form(capsys):
    from bench import bench_gemm

    assert bench_gemm.main(["--forms=contract,mkl"]) == 2
    err = capsys.readouterr().err
    assert "--forms=contract,mkl: use a comma list of contract, copy, copy_values" in err
    assert len(err.strip().splitlines()) == 1


REAL_MODEL_BENCHES = [
    ("bench_accumulation", []),
    ("bench_checkpoint_memory", []),
    ("bench_decode_real", ["--model={missing}"]),
    ("bench_decode_widths", []),
    ("bench_trim", []),
    ("bench_vs_trl", []),
    ("bench_vs_tunix", []),
    ("profile_decode", ["--batch=1"]),
    ("real_packing", []),
    ("real_profile", []),
    ("real_prompts", []),
    ("train_step_xla", ["--model_dir={missing}"]),
]


@pytest.mark.parametrize("name, flags", REAL_MODEL_BENCHES, ids=[n for n, _ in REAL_MODEL_BENCHES])
def test_a_real_model_bench_without_the_model_says_so_in_one_line(
    name, flags, tmp_path, monkeypatch, capsys
):
    """Every bench on the real model stops before timing anything, with exit code 2 and one
    line naming the directory and `make real-model`, when the weights are not there."""
    import importlib

    module = importlib.import_module(f"bench.{name}")
    missing = tmp_path / "no-model"
    monkeypatch.setattr(module, "MODEL_DIR", missing)
    argv = [f.format(missing=missing) for f in flags]
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", *argv])
    with pytest.raises(SystemExit) as exited:
        module.main(argv) if flags else module.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: no model at {missing}: run `make real-model` first"]


def test_require_model_returns_a_model_directory(tmp_path):
    from bench import common

    (tmp_path / "config.json").write_text("{}")
    assert common.require_model(str(tmp_path)) == tmp_path
