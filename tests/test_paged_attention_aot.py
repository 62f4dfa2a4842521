"""Ahead-of-time compile of the paged decode kernel for sm_90 (H100/H200), no GPU needed.

Each production configuration is compiled with `triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))` using the launch parameters the jax-triton call ships and
the signature jax-triton builds (every array pointer 16-byte aligned, int32 tables). The
resource usage comes from the `cuobjdump` inside the Triton wheel. Checked: no spills (no
local memory, no stack), registers within budget, shared memory within the H100 limit (which
triton.compile does not enforce), and 16-byte loads on the K/V path.

Compiles run in a subprocess (this file run as a script) with a fresh Triton cache, so ptxas
really runs, and with a per-configuration alarm: a runaway ptxas cannot hang the suite.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REGISTER_BUDGET = 128           # 4 warps at <= 128 registers keeps >= 4 programs per SM
COMPILE_TIMEOUT_S = 60
TRITON_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# (dtype, head_dim, kv_heads, group, page_size): Llama-3-8B-like, GQA 1/4/8, the bench model.
CONFIGS = [
    ("bfloat16", 128, 8, 4, 16),
    ("bfloat16", 128, 4, 8, 16),
    ("bfloat16", 128, 8, 1, 16),
    ("bfloat16", 64, 4, 2, 16),
    ("bfloat16", 128, 8, 4, 64),
    ("float16", 128, 8, 4, 16),
    ("float32", 64, 4, 2, 16),
    ("float32", 128, 8, 4, 16),
]


def _config_id(cfg):
    dtype, d, k, g, s = cfg
    return f"{dtype}-D{d}-K{k}-G{g}-S{s}"


def compile_config(cfg):
    """Compiles one configuration exactly as the jax-triton path launches it; returns facts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pipelinerl_jax.kernels import paged_attention_triton as pt

    dtype, head_dim, kv_heads, group, page = cfg
    batch, pages, pages_per_seq = 64, 4096, 128
    params = pt.contiguous_launch_params(
        (batch, kv_heads * group, head_dim), (pages, kv_heads, page, head_dim),
        (batch, pages_per_seq), dtype=dtype, scale=head_dim ** -0.5)
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    kernel = pt.paged_decode_kernel
    pointer_args = kernel.arg_names[:6]  # q, k, v, block_tables, lengths, out (then constexprs)
    signature = {name: "*" + ("i32" if name in ("block_tables_ptr", "lengths_ptr")
                              else TRITON_TYPES[dtype]) for name in pointer_args}
    signature.update({name: "constexpr" for name in params.constexprs})
    assert list(signature) == kernel.arg_names, "kernel arguments changed: update this check"
    # jax-triton assumes every array is 16-byte aligned and says so to the compiler.
    attrs = {(i,): backend.parse_attr("D") for i in range(len(pointer_args))}
    compiled = triton.compile(ASTSource(kernel, signature, params.constexprs, attrs),
                              target=target,
                              options=dict(num_warps=params.num_warps,
                                           num_stages=params.num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True,
                               timeout=COMPILE_TIMEOUT_S).stdout
    fields = dict((k, int(v)) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    ptx = compiled.asm["ptx"]
    return dict(
        registers=fields["REG"], stack=fields["STACK"], local=fields["LOCAL"],
        shared=int(compiled.metadata.shared), num_warps=params.num_warps,
        # K/V rows arrive through cp.async (pipelined) or plain vector loads, 16 bytes each.
        loads_16b=len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10",
                                 ptx)) + len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)),
        loads_2b=len(re.findall(r"ld\.global(?:\.\w+)*\.(?:b16|u16)\b", ptx)),
        kernel_name=compiled.metadata.name)


def _alarm(signum, frame):
    raise TimeoutError(f"compile exceeded {COMPILE_TIMEOUT_S}s")


def _main(out_path):
    signal.signal(signal.SIGALRM, _alarm)
    results = {}
    for cfg in CONFIGS:
        signal.alarm(COMPILE_TIMEOUT_S)
        try:
            results[_config_id(cfg)] = compile_config(cfg)
        except Exception as err:  # reported per configuration by the test
            results[_config_id(cfg)] = dict(error=f"{type(err).__name__}: {err}"[:2000])
        finally:
            signal.alarm(0)
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aot")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp / "cache"), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen([sys.executable, __file__, str(tmp / "out.json")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=COMPILE_TIMEOUT_S * len(CONFIGS))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the compiler and any ptxas it started
        proc.communicate()
        pytest.fail("sm_90 compile of the paged kernel timed out")
    assert proc.returncode == 0, log[-4000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("cfg", CONFIGS, ids=[_config_id(c) for c in CONFIGS])
def test_sm90_compile_resources(compiled, cfg):
    res = compiled[_config_id(cfg)]
    assert "error" not in res, res.get("error")
    assert res["local"] == 0 and res["stack"] == 0, f"register spills: {res}"
    assert res["registers"] <= REGISTER_BUDGET, res
    assert 0 < res["shared"] <= 232448, f"shared memory over the H100 limit: {res}"
    if cfg[0] != "float32":
        assert res["loads_16b"] >= 8, f"K/V path lost its 16-byte loads: {res}"
        assert res["loads_2b"] == 0, f"scalar 2-byte loads in the kernel: {res}"


if __name__ == "__main__":
    _main(sys.argv[1])
