"""`python -m pipelinerl_jax.plan` on the bundled sample profile: table, PNGs, bad requests."""

import json
import subprocess
import sys

import pytest

from pipelinerl_jax.plan import __main__ as cli
from pipelinerl_jax.plan import utilisation as util

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "pipelinerl_jax.plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_bundled_sample_profile_is_complete():
    prof = util.load_profile(cli.SAMPLE_PROFILE)
    assert util.utilisation_from_profile(prof).max_batch >= 256
    dec = util.decode_curve_from_profile(prof)
    assert dec.unit == util.UNIT_TOKENS_PER_S and len(dec.batch_sizes) >= 4
    assert prof["train"]["tokens_per_s_per_device"] > 0


def test_cli_seconds_mode_on_sample(tmp_path):
    out = tmp_path / "figs"
    r = _run("--devices=8", "--batch=32", "--max_lag=4", "--max_len=256", f"--out_dir={out}")
    assert r.returncode == 0, r.stderr
    assert "seconds mode" in r.stdout and "tokens/s" in r.stdout
    assert "speedup over Conventional" in r.stdout
    for name in ("utilisation.png", "throughput_vs_lag.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    plan = json.loads((out / "plan.json").read_text())
    assert plan["devices"] == 8 and 1 <= plan["gen_devices"] <= 7
    assert plan["lag"] <= 4 and plan["max_lag"] == 4
    # The rates recomputed from the profile itself, not from the plan's own fields:
    # r_train = (N - I) x training tokens/s per device; r_gen = I x the measured decode rate
    # at the chosen per-device batch H (H / seconds per step, tokens/s).
    prof = util.load_profile(cli.SAMPLE_PROFILE)
    dec = util.decode_curve_from_profile(prof)
    n_gen, h = plan["gen_devices"], plan["gen_batch"]
    r_train = (8 - n_gen) * prof["train"]["tokens_per_s_per_device"]
    measured = dict(zip(prof["decode"]["batch_sizes"], prof["decode"]["latency_s"]))
    r_gen = n_gen * (h / measured[h] if h in measured else float(dec.rate(h)))
    assert plan["r_train"] == pytest.approx(r_train) and plan["r_gen"] == pytest.approx(r_gen)
    assert plan["r"] == pytest.approx(min(r_gen, r_train))
    assert plan["conventional"]["steps_per_round"] == 5


def test_cli_flash_mode_fixed_split_and_lengths_file(tmp_path):
    lengths = tmp_path / "metrics.jsonl"
    lengths.write_text(
        "\n".join(json.dumps({"kind": "sampler", "lengths": [5, 40, 100]}) for _ in range(3))
        + "\n"
        + json.dumps({"length": 7})
        + "\n"
    )
    r = _run(
        "--units=flash",
        "--tau=5",
        "--devices=16",
        "--batch=64",
        "--max_lag=6",
        "--gen_devices=4",
        f"--lengths={lengths}",
        f"--out_dir={tmp_path}",
    )
    assert r.returncode == 0, r.stderr
    assert "tokens/flash" in r.stdout and "tau=5" in r.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["gen_devices"] == 4
    assert plan["r_train"] == pytest.approx(12 / 5)
    assert "L=100" in r.stdout


def test_cli_reproduce_paper(tmp_path):
    r = _run("--reproduce_paper", f"--out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    for expect in ("16.900", "17.076", "10.744", "1.573x", "132"):
        assert expect in r.stdout
    assert (tmp_path / "throughput_vs_lag.png").read_bytes()[:8] == PNG_MAGIC
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert (plan["gen_batch"], plan["gen_devices"]) == (192, 44)


@pytest.mark.parametrize(
    "args,expect",
    [
        (["--devices=16", "--gen_devices=20", "--max_lag=3"], "--gen_devices <= 15"),
        (["--devices=16", "--batch=64", "--max_lag=0"], "raise --max_lag to >= 1"),
        (["--devices=8", "--batch=32", "--max_lag=4", "--gen_batch=4096"], "--gen_batch=4096"),
        (["--devices=128", "--batch=128", "--max_lag=40"], "re-measure up to batch 41"),
        (["--devices=8"], "--max_lag is required"),
        (["--devices=8", "--max_lag=2", "--profile=/nonexistent.json"], "no such file"),
        (["--max_lag=2", "--lengths=/nonexistent.json"], "--lengths=/nonexistent.json"),
        (["--devices=1", "--max_lag=2"], "at least 2 devices"),
        (["--max_lag=2", "--tau=0"], "--tau=0: must be > 0"),
        (["--max_lag=2", "--train_tokens_per_s=-5"], "--train_tokens_per_s=-5: must be > 0"),
        (["--max_lag=2", "--plot_max_lag=-3"], "--plot_max_lag=-3: must be >= 1"),
        (["bogus", "--max_lag=2"], "unknown command"),
        (["--model=qwen2.5-7b", "--max_lag=2"], "--model only shape(s) a --gpu prediction"),
        (["--sampler_tp=4", "--compiled=x.json", "--max_lag=2"], "--sampler_tp, --compiled"),
        # Paths under a file (this one): refused before any planning or timing.
        (["--max_lag=2", f"--out_dir={__file__}/x"], f"{__file__} is a file"),
        (["measure", f"--out={__file__}/p.json"], f"{__file__} is a file"),
        (["measure", "--engine_model=/no/such/model"], "not 'tiny' nor a checkpoint directory"),
    ],
)
def test_cli_bad_requests_exit_2_with_one_line(args, expect):
    r = _run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and expect in err[0], r.stderr
    assert "Traceback" not in r.stderr


def test_plan_warns_when_the_profile_is_not_the_target_hardware(tmp_path):
    r = _run("--devices=8", "--batch=32", "--max_lag=4", "--max_len=256", f"--out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "bundled sample profile" in r.stderr and "plan measure" in r.stderr
    assert "load average of 7.0" in r.stderr  # the sample was measured on a busy 2-core host
    # A profile of the target accelerators, measured on an idle host: no warning.
    gpu = util.load_profile(cli.SAMPLE_PROFILE) | {
        "backend": "gpu",
        "device_kind": "NVIDIA H100",
        "host_cpus": 64,
        "loadavg_1m_at_start": 0.1,
    }
    assert cli.profile_warnings(gpu, str(tmp_path / "h100.json")) == []
    cpu = dict(gpu, backend="cpu", device_kind="cpu")
    (line,) = cli.profile_warnings(cpu, str(tmp_path / "cpu.json"))
    assert "measured on cpu (cpu, 64 host CPUs" in line
