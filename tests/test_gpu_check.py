"""bench/gpu_check.py and bench/gpu_bundle.sh, checked here so a lent GPU's minutes are not lost.

The rehearsal runs the GPU check's whole code path at tiny sizes on CPU, in its own process (as
on the GPU machine), and every stage must come back with figures or a recorded reason, every
measurement with its prediction (or why there is none), and a log. The bundle's dry run must
name every wheel the GPU machine lacks, without touching the network. The budget, failure and
missing-roofline paths are checked in-process, without JAX.
"""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.xla_env import child_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu_check, gpu_check_harness, gpu_check_predict  # noqa: E402

# What the GPU image already has (device KINDS.md's package list), of requirements-base.txt's
# packages: the rest must travel as wheels.
ON_GPU_MACHINE = {
    "absl-py",
    "safetensors",
    "tokenizers",
    "jinja2",
    "numpy",
    "pyarrow",
    "matplotlib",
    "tqdm",
}
# Wheels the GPU machine needs beyond requirements-base.txt's own names (their dependencies
# it lacks, and the GPU pins of requirements-gpu.txt).
EXTRA_WHEELS = {
    "flax": "0.12.12",
    "jax-triton": "0.3.1",
    "array-record": None,
    "portpicker": None,
    "latex2sympy2_extended": None,
    "antlr4-python3-runtime": None,
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name.lower())


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[_norm(name)] = version.strip()
    return pins


@pytest.mark.slow
def test_cpu_rehearsal_records_every_stage_with_figures_or_a_reason(tmp_path):
    out = tmp_path / "out"
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu_rehearsal", f"--out={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "gpu_check.json").read_text())
    assert record["format"] == gpu_check_harness.FORMAT and record["mode"] == "cpu_rehearsal"
    stages = record["stages"]
    assert list(stages) == list(gpu_check.STAGES)
    for name, stage in stages.items():
        assert stage["status"] in ("ok", "skipped"), (name, stage)
        if stage["status"] == "skipped":
            assert stage["reason"], name
    # The kernel test needs a GPU: skipped here, saying so.
    assert stages["kernel_test"]["status"] == "skipped"
    assert "GPU" in stages["kernel_test"]["reason"]
    env_stage = stages["env"]
    assert env_stage["versions"]["jax"] and env_stage["devices"] and env_stage["device_kind"]

    # Every measurement with its prediction beside it, or why there is none.
    def predicted(row, key):
        pred = row["predicted"]
        assert key in pred or pred["unavailable"].startswith("prediction unavailable: "), pred

    decode = stages["decode"]["rows"]
    assert [r["batch"] for r in decode] == list(gpu_check.REHEARSAL.batches)
    for row in decode:
        assert row["ours_tok_s"] > 0, row
        assert row.get("hf_tok_s", 0) > 0 or row["hf_skipped"], row
        predicted(row, "tok_s")
    train = stages["train"]["rows"]
    assert train
    for row in train:
        assert row["tok_s"] > 0 and 0 < row["mfu"] < 1, row
        predicted(row, "tok_s")
    pipeline = stages["pipeline"]
    assert pipeline["steps_done"] >= 1 and pipeline["lag_hist"]
    for key in ("swap_pause_ms_mean", "reward_start", "reward_end", "lag_max"):
        assert pipeline[key] is not None, key
    table = stages["predictions"]["table"]
    assert len(table) == len(decode) + 2 * len(train)
    for row in table:
        assert row["measured"] is not None and row["predicted"] is not None, row

    log = (out / "gpu_check.log").read_text()
    for name in gpu_check.STAGES:
        assert f"{name}: start" in log, name
    assert (out / "pipeline_metrics.jsonl").exists()


def _check(tmp_path, budgets):
    args = SimpleNamespace(stages=list(budgets), cpu_rehearsal=True, hard_limit_s=60.0)
    return gpu_check_harness.Check(tmp_path, args, budgets)


def test_a_stage_past_the_total_budget_is_skipped_and_failures_are_recorded(tmp_path):
    check = _check(tmp_path, dict(env=0.0))
    check.run_stage("env", lambda ctx: pytest.fail("must not run past the budget"))
    stage = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]["env"]
    assert stage["status"] == "skipped" and "budget" in stage["reason"]

    check = _check(tmp_path, dict(env=60.0, decode=60.0, train=60.0))

    def broken(ctx):
        ctx.rec["partial"] = 1
        raise ValueError("boom")

    def not_here(ctx):
        raise gpu_check_harness.Skip("not on this machine")

    check.run_stage("env", broken)
    check.run_stage("decode", not_here)
    check.run_stage("train", lambda ctx: ctx.problem("a check failed"))
    stages = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]
    assert stages["env"]["status"] == "failed" and stages["env"]["partial"] == 1
    assert "ValueError: boom" in stages["env"]["error"]
    assert stages["decode"]["status"] == "skipped"
    assert stages["decode"]["reason"] == "not on this machine"
    assert stages["train"]["status"] == "failed" and stages["train"]["problems"]
    assert "env: failed" in (tmp_path / "gpu_check.log").read_text()


def _replace_roofline(monkeypatch, module):
    """`from pipelinerl_jax.plan import roofline` gives `module` (None: the import fails)."""
    plan = importlib.import_module("pipelinerl_jax.plan")
    monkeypatch.setitem(sys.modules, "pipelinerl_jax.plan.roofline", module)
    if module is None:
        monkeypatch.delattr(plan, "roofline", raising=False)
    else:
        monkeypatch.setattr(plan, "roofline", module, raising=False)


def test_a_missing_roofline_is_recorded_as_prediction_unavailable(monkeypatch):
    _replace_roofline(monkeypatch, None)
    pred = gpu_check_predict.predict_decode(None, None, batch=1, context_len=8)
    assert pred["unavailable"].startswith("prediction unavailable: ModuleNotFoundError")
    pred = gpu_check_predict.predict_train(None, None, tokens=64, seq_len=64, remat=False)
    assert pred["unavailable"].startswith("prediction unavailable: ")


def test_a_roofline_with_another_signature_is_recorded_not_fatal(monkeypatch):
    fake = SimpleNamespace(
        decode_step_cost=lambda cfg, *, batches: None,  # not the agreed keywords
        train_step_cost=lambda cfg: None,
        seconds=lambda cost, gpu, dtype: 1.0,
    )
    _replace_roofline(monkeypatch, fake)
    pred = gpu_check_predict.predict_decode(None, None, batch=1, context_len=8)
    assert pred["unavailable"].startswith("prediction unavailable: TypeError")


def test_the_wrapper_and_the_docstring_carry_the_same_command():
    command = next(line.strip() for line in gpu_check.__doc__.splitlines() if "pip install" in line)
    assert command.endswith("python3 bench/gpu_check.py --out=$OUT")
    assert command in (ROOT / "bench" / "gpu_check.sh").read_text()


def test_bundle_dry_run_lists_every_wheel_the_gpu_machine_lacks():
    # No network: a pip that tried would find this proxy closed.
    env = dict(os.environ, PIP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9")
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_bundle.sh"), "--dry_run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    listed = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\s+([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            listed[_norm(m.group(1))] = m.group(2)
    assert len(listed) == len(re.findall(r"^\s+\S+==", proc.stdout, re.M)), "one version each"
    base = _pins(ROOT / "requirements-base.txt")
    gpu = _pins(ROOT / "requirements-gpu.txt")
    wanted = {name: version for name, version in base.items()}
    wanted.update({_norm(k): v for k, v in EXTRA_WHEELS.items()})
    for name, version in wanted.items():
        if name in {_norm(n) for n in ON_GPU_MACHINE}:
            continue
        assert name in listed, f"{name} is not in bench/gpu_bundle.sh's list"
        if version is not None:
            assert listed[name] == version, (name, listed[name], version)
    # The GPU pins travel as requirements-gpu.txt states them.
    for name in ("flax", "jax_triton"):
        assert listed[name] == gpu[name], name
