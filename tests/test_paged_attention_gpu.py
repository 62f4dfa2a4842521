"""GPU smoke test: the shipped jax-triton kernel path against the jnp reference, on the GPU.

The test process runs JAX on CPU (tests/conftest.py), so the check runs in a subprocess with the
CUDA platform: this file run as a script. `make test` installs no GPU packages, so there it is
skipped; `make test-gpu` builds .venv-gpu from requirements-gpu.txt (jax CUDA plugin, jax-triton)
and runs the gpu-marked tests with PIPELINERL_REQUIRE_GPU=1, under which a missing GPU,
CUDA plugin or jax-triton fails the test instead of skipping it. Everything it checks without a
GPU is covered by the interpreter and sm_90 compile tests.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# (dtype, kv_heads, group, head_dim, page_size)
CONFIGS = [
    ("float32", 4, 2, 64, 16),
    ("bfloat16", 4, 2, 64, 16),
    ("bfloat16", 8, 4, 128, 16),
    ("bfloat16", 8, 1, 128, 32),
    ("float16", 2, 8, 128, 16),
]
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


def _gpu_stack_missing() -> list:
    """What this machine lacks for the GPU test (empty when it can run)."""
    missing = []
    gpus = Path("/proc/driver/nvidia/gpus")
    if not (gpus.is_dir() and any(gpus.iterdir())):
        missing.append("an NVIDIA GPU")
    if not any(
        importlib.util.find_spec(name) is not None
        for name in ("jax_cuda12_plugin", "jax_cuda13_plugin")
    ):
        missing.append("the jax CUDA plugin")
    if importlib.util.find_spec("jax_triton") is None:
        missing.append("jax-triton")
    return missing


def _check(out_path):
    import jax
    import jax.numpy as jnp

    from pipelinerl_jax.kernels import paged_attention as pa

    assert jax.default_backend() == "gpu", jax.default_backend()
    assert pa.triton_available(), "NVIDIA GPU present but the Triton path is not selected"
    results = {}
    for dtype, kv_heads, group, head_dim, page in CONFIGS:
        rng = np.random.default_rng(0)
        lengths = np.array([0, 1, page + 3, 4 * page, 37 * page, 64 * page - 1], np.int32)
        batch, pages_per_seq = len(lengths), 64
        num_pages = batch * pages_per_seq + 4
        q = rng.standard_normal((batch, kv_heads * group, head_dim))
        k = rng.standard_normal((num_pages, kv_heads, page, head_dim))  # [P, K, S, D]
        v = rng.standard_normal((num_pages, kv_heads, page, head_dim))
        k[-4:] = v[-4:] = np.nan  # garbage pages past every sequence's end
        tables = rng.choice(np.arange(num_pages - 4, num_pages), (batch, pages_per_seq))
        owned = rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)
        for b, length in enumerate(lengths):
            used = -(-length // page)
            tables[b, :used] = owned[b, :used]
        args = [jnp.asarray(x, dtype) for x in (q, k, v)] + [
            jnp.asarray(tables, jnp.int32),
            jnp.asarray(lengths),
        ]
        scale = head_dim**-0.5
        fast = jax.jit(lambda *a: pa.paged_decode_attention(*a, scale=scale, impl="auto"))
        ref = jax.jit(lambda *a: pa.paged_decode_attention(*a, scale=scale, impl="ref"))
        out = np.asarray(fast(*args), np.float32)
        # XLA:GPU runs f32 dots in TF32 by default (~1e-3 off); the kernel's f32 dots are IEEE.
        with jax.default_matmul_precision("highest"):
            want = np.asarray(ref(*args), np.float32)
        results[f"{dtype}-K{kv_heads}-G{group}-D{head_dim}-S{page}"] = dict(
            dtype=dtype,
            max_err=float(np.nan_to_num(np.abs(out - want), nan=np.inf).max()),
            zero_len_zeros=bool(np.all(out[0] == 0)),
        )
    Path(out_path).write_text(json.dumps(results))


@pytest.mark.gpu
def test_jax_triton_kernel_matches_reference_on_gpu(tmp_path):
    missing = _gpu_stack_missing()
    if missing:
        why = (
            f"needs {', '.join(missing)}: run `make test-gpu` on an NVIDIA GPU machine (it "
            "builds .venv-gpu from requirements-gpu.txt)"
        )
        if os.environ.get("PIPELINERL_REQUIRE_GPU") == "1":
            pytest.fail(why)
        pytest.skip(why)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cuda",
        TRITON_DEFAULT_FP_FUSION="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path / "out.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "out.json").read_text())
    assert len(results) == len(CONFIGS)
    for name, res in results.items():
        assert res["zero_len_zeros"], name
        assert res["max_err"] <= TOLERANCE[res["dtype"]], (name, res)


if __name__ == "__main__":
    _check(sys.argv[1])
