"""The whole pipeline on 8 simulated devices: a 4-device sampler mesh (2 data x 2 tensor-
parallel) and a 4-device trainer mesh (2 fsdp x 2 tp). Weights published by the trainer land on
the sampler's tensor-parallel layout every step without recompiling, and the run's accounting
(lag bound, version tags, swaps) holds as on one device.

Runs launch.py in a subprocess because simulated CPU devices must be configured before JAX
starts.
"""

import json
import subprocess
import sys
from pathlib import Path

from tests.xla_env import child_env

ROOT = Path(__file__).resolve().parents[1]


def test_tensor_parallel_sampler_and_trainer_run_end_to_end(tmp_path):
    env = child_env(8, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        "--config=configs/tiny.py",
        f"--workdir={tmp_path}",
        "--config.steps=4",
        "--config.max_lag=1",
        "--config.devices.sampler=4",
        "--config.devices.sampler_tp=2",
        "--config.devices.trainer_tp=2",
        "--config.model.init.num_kv_heads=2",
        "--config.eval_every=0",
        # Every prefill shape compiled by warm_up before step 0 (otherwise a new prompt
        # length or row count compiles on first use, at any step, and says nothing about
        # publishing): what remains to recompile mid-run is the weight path.
        "--config.sampler.prefill_pad_tokens=true",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [0, 1, 2, 3]
    # "Without recompiling": each step's record counts the compilations paid since the last
    # (compile_watch.py). Step 0 pays the warm-up (decode chunk, prefill shapes, train step,
    # the first publish); every later step, each after a publish, compiles nothing.
    counts = [r["compile/count"] for r in train]
    assert counts[0] > 0 and counts[1:] == [0, 0, 0], counts
    summary = next(r for r in records if r["kind"] == "summary")
    assert summary["lag/token_max"] <= summary["lag/bound"] == 1
    assert summary["sampler/swaps"] >= 1
    assert {int(k) for k, v in summary["lag/hist"].items() if v} <= {0, 1}
    assert sum(summary["lag/hist"].values()) > 0
