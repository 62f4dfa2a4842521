"""Several hosts in the planner: whole hosts per role, and the weight transfer's lag, by hand."""

import math
import subprocess
import sys

import numpy as np
import pytest

from pipelinerl_jax.plan import hosts as hosts_lib
from pipelinerl_jax.plan import layout, model
from pipelinerl_jax.plan import utilisation as util
from pipelinerl_jax.plan.utilisation import PlanError

# As in test_plan_layout: 10 ms per decode step at batch 1, 12 ms at 4, 16 ms at 8; 300
# training tokens/s per device; lengths uniform on 1..9 (mean 5).
PROF = layout.DeviceProfile.from_measurements(
    decode_batch_sizes=[1, 4, 8],
    decode_latency_s=[0.010, 0.012, 0.016],
    train_tokens_per_s_per_device=300.0,
)
DIST = model.LengthDistribution.uniform(9)


def test_transfer_time_and_lag_by_hand():
    h = hosts_lib.Hosts(8, param_bytes=2e9, transfer_bytes_per_s=1e9)
    # 16 generation devices = 2 sampler hosts, 2 GB each through one 1 GB/s link: 4 s.
    assert h.transfer_s(np.array([16]))[0] == pytest.approx(4.0)
    # A step of B·L̄ = 64·100 tokens at 2000 tokens/s takes 3.2 s: 4 s is 1.25 steps -> +2.
    assert h.transfer_lag(np.array([[2000.0]]), np.array([16]), 64, 100.0)[0, 0] == 2
    # At 1000 tokens/s a step is 6.4 s: the transfer fits in one -> +1.
    assert h.transfer_lag(np.array([[1000.0]]), np.array([16]), 64, 100.0)[0, 0] == 1
    assert list(h.gen_devices_ok(np.arange(1, 32))) == [i % 8 == 0 for i in range(1, 32)]


def test_plan_over_hosts_by_hand():
    # 4 devices, 2 per host: one host samples (I = 2), one trains (600 tokens/s). With no
    # transfer the plan is the one-host plan restricted to I = 2: H = 4 makes 2·4/0.012 = 667
    # tokens/s >= 600, H = 3 makes 529; g_max = ceil(4·2·9 / (5·8)) = 2.
    work = layout.Workload(4, 8, DIST, max_lag=10, hosts=hosts_lib.Hosts(2))
    plan = layout.plan_layout(PROF, work, compare_conventional=False)
    assert (plan.gen_devices, plan.gen_batch, plan.lag) == (2, 4.0, 2)
    assert plan.r == pytest.approx(600.0) and plan.transfer_lag == 0
    # 1000 bytes at 10 kB/s: 0.1 s per version; a step is 8·5/600 = 0.0667 s -> +2 lag.
    slow = hosts_lib.Hosts(2, param_bytes=1000, transfer_bytes_per_s=10_000)
    plan = layout.plan_layout(
        PROF, layout.Workload(4, 8, DIST, max_lag=10, hosts=slow), compare_conventional=False
    )
    assert (plan.gen_batch, plan.r) == (4.0, pytest.approx(600.0))
    assert plan.transfer_s == pytest.approx(0.1) and plan.transfer_lag == 2 and plan.lag == 4
    text = layout.format_plan(plan, layout.Workload(4, 8, DIST, max_lag=10, hosts=slow))
    assert "1 sampling, 1 training (2 devices each)" in text and "+2 lag" in text
    # Under a bound of 3 the planner gives up rate for a smaller batch whose lag, transfer
    # included, fits: every split it may pick satisfies g_max + transfer lag <= 3.
    plan = layout.plan_layout(
        PROF, layout.Workload(4, 8, DIST, max_lag=3, hosts=slow), compare_conventional=False
    )
    g_max = math.ceil(plan.gen_batch * plan.gen_devices * 9 / (5 * 8))
    extra = math.ceil(0.1 / (8 * 5 / plan.r) - 1e-12)
    assert plan.lag == g_max + extra <= 3 and plan.r < 600.0


def test_hosts_refusals():
    with pytest.raises(PlanError, match="whole hosts, at least 2"):
        layout.plan_layout(PROF, layout.Workload(6, 8, DIST, 10, hosts=hosts_lib.Hosts(4)))
    with pytest.raises(PlanError, match="needs the weights' size"):
        hosts_lib.Hosts(2, transfer_bytes_per_s=1e9)
    with pytest.raises(PlanError, match="must be positive"):
        hosts_lib.Hosts(2, param_bytes=1, transfer_bytes_per_s=0)
    # The paper's units (tokens per flash) cannot meet a bandwidth in bytes per second.
    curve = util.roofline_curve([1, 8, 64, 512], peak_flops=1e15, bandwidth=3e12)
    flash = layout.DeviceProfile(curve, 5.0)
    with pytest.raises(PlanError, match="seconds mode"):
        layout.plan_layout(flash, layout.Workload(4, 8, DIST, 10, hosts=hosts_lib.Hosts(2, 1, 1.0)))


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pipelinerl_jax.plan", "--batch=32", "--max_lag=4", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_hosts_on_the_sample_profile(tmp_path):
    """The sample profile carries a measured weight-transfer bandwidth and its model's size."""
    r = _cli("--devices=8", "--devices_per_host=2", "--max_len=256", f"--out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "hosts:" in r.stdout and "GB/s" in r.stdout and "lag)" in r.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--devices=8", "--transfer_gb_per_s=1"], "give --devices_per_host too"),
        (["--devices=8", "--devices_per_host=3"], "use a multiple of 3 that is >= 6"),
        (["--devices=8", "--devices_per_host=2", "--transfer_gb_per_s=-1"], "must be positive"),
    ],
)
def test_cli_hosts_bad_requests_are_one_line(tmp_path, args, message):
    r = _cli(*args, f"--out_dir={tmp_path}")
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if not x.startswith("WARNING")]
    assert len(lines) == 1 and message in lines[0], r.stderr
