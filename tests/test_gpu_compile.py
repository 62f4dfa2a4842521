"""The GPU program compiled for an H100 topology without a GPU (plan/gpu_compile.py), and the
trace-time target (kernels/target.py) that makes that program the GPU's, not the CPU's.

The compile itself needs jax 0.11 with the CUDA plugin (`make test-jax011` / `make
compile-h100` build that venv); under `make test` it is skipped with the reason. Everything else
here runs everywhere.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.kernels import paged_attention as pa
from pipelinerl_jax.kernels import target
from pipelinerl_jax.models import decoder, mixed_matmul, remat
from pipelinerl_jax.models.known_shapes import KNOWN_HF_CONFIGS, known_config
from pipelinerl_jax.plan import gpu_compile
from pipelinerl_jax.plan.gpu_specs import gpu_spec

REPO = Path(__file__).resolve().parents[1]
UNAVAILABLE = gpu_compile.available()


def test_target_defaults_to_this_process_and_nests():
    assert target.current() is None
    assert target.platform() == jax.default_backend()
    with target.compiling_for("gpu", 90):
        assert target.platform() == "gpu"
        assert target.current().compute_capability == 90
        with target.compiling_for("cpu"):
            assert target.platform() == "cpu"
        assert target.platform() == "gpu"
    assert target.current() is None


def _primitives(fn, *args) -> set[str]:
    return {eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns}


def test_cpu_only_layouts_follow_the_target_not_the_process():
    """The physical transpose and the bit-pattern saves are CPU layouts: a program traced for
    a GPU must not carry them, even when a CPU process traces it."""
    x = jax.random.normal(jax.random.key(0), (6, 4)).astype(jnp.bfloat16)
    assert "concatenate" in _primitives(mixed_matmul.lhs_transposed, x)
    with target.compiling_for("gpu", 90):
        assert "concatenate" not in _primitives(mixed_matmul.lhs_transposed, x)
        np.testing.assert_array_equal(mixed_matmul.lhs_transposed(x), x.T)

    def saved(v):
        return jax.checkpoint(lambda u: remat.keep(u * 2.0, "attn_out") + 1.0)(v)

    assert "bitcast_convert_type" in str(jax.make_jaxpr(saved)(x))
    with target.compiling_for("gpu", 90):
        assert "bitcast_convert_type" not in str(jax.make_jaxpr(saved)(x))


def test_kernel_dispatch_follows_the_target(monkeypatch):
    assert not pa.triton_available()  # CPU process, no target set
    monkeypatch.setattr(pa, "_jax_triton_imports", lambda: True)
    with target.compiling_for("gpu", 90):
        assert pa.triton_available()
    with target.compiling_for("cpu"):
        assert not pa.triton_available()


def test_compute_capability_is_passed_only_ahead_of_time():
    def new_call(*args, out_shape=None, compute_capability=None, **kw): ...

    def old_call(*args, out_shape=None, **kw): ...

    assert pa._compute_capability(new_call) == {}
    with target.compiling_for("gpu", 90):
        assert pa._compute_capability(new_call) == {"compute_capability": 90}
        with pytest.raises(pa.PagedAttentionImplError, match="compute_capability"):
            pa._compute_capability(old_call)


@pytest.mark.parametrize(
    "name, billions", [("smollm2-135m", 0.1345), ("qwen2.5-1.5b", 1.5437), ("qwen2.5-7b", 7.6156)]
)
def test_known_shapes_have_the_published_parameter_counts(name, billions):
    params = decoder.abstract_init(known_config(name))[1]
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert abs(count / 1e9 - billions) < 5e-4


def test_unknown_names_say_what_is_known():
    with pytest.raises(ValueError, match="qwen2.5-7b"):
        known_config("qwen9")
    with pytest.raises(ValueError, match="h100"):
        gpu_spec("a100x")
    assert set(KNOWN_HF_CONFIGS) >= {"smollm2-135m", "qwen2.5-1.5b", "qwen2.5-7b"}


def test_target_config_states_the_gpu():
    text = gpu_spec("h100").target_config()
    assert "device_memory_size: 84942979072" in text
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert 'platform_name: "CUDA"' in text


def test_compile_cli_refuses_bad_input_in_one_line():
    proc = subprocess.run(
        [sys.executable, "bench/compile_h100.py", "--models=qwen9"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "qwen9" in proc.stderr


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no GPU compile here: {UNAVAILABLE}")
def test_smallest_gpu_program_compiles_for_an_h100(tmp_path):
    """The bench model's decode chunk (Triton kernel in the program), its FSDP x TP train step
    over 8 H100s and the publish path, compiled on this CPU machine."""
    out = tmp_path / "compile.json"
    proc = subprocess.run(
        [sys.executable, "bench/compile_h100.py", "--quick", "--sampler_tps=1", f"--out={out}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["format"] == gpu_compile.FORMAT and result["jax"].startswith("0.11")
    by_program = {}
    for r in result["records"]:
        by_program.setdefault(r["program"], []).append(r)
    decode = by_program["decode_chunk"][0]
    assert decode["ok"] and decode["triton_kernel"], decode
    assert decode["memory"]["argument_bytes"] > 0
    train = by_program["train_step"]
    assert {r["dtype"] for r in train} == {"float32", "bfloat16"}
    for r in train:
        assert r["ok"] and r["devices"] == 8, r
        assert {"all-gather", "reduce-scatter"} <= set(r["collectives"]) or "all-reduce" in set(
            r["collectives"]
        )
        mem = r["memory"]
        assert mem["peak_bytes"] == (
            mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"]
        )
    assert {"publish_gather", "publish_copy", "publish_prepare"} <= set(by_program)


def test_compile_cli_reports_a_skipped_layout_in_one_line():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import compile_h100
    finally:
        sys.path.remove(str(REPO / "bench"))
    r = compile_h100.skip("decode_chunk", "bench", gpu_spec("h100"), 8, {"tp": 8}, "heads")
    assert r["ok"] is None and r["gpu"] == "h100" and r["skipped"] == "heads"
    assert compile_h100.summary_line(r).endswith("skipped: heads")
