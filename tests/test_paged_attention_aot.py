"""Ahead-of-time compile of the paged decode kernel for sm_90 (H100/H200), no GPU needed.

Each production configuration is compiled with `triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))` using the launch parameters the jax-triton call ships and
the signature jax-triton builds (every array pointer 16-byte aligned, int32 tables). The
resource usage comes from the `cuobjdump` inside the Triton wheel. Checked: no spills (no
local memory, no stack), registers within budget, shared memory within the H100 limit (which
triton.compile does not enforce), 16-byte loads on the K/V path, and for 16-bit caches the
round-to-nearest conversion of the probabilities that the interpreter tests reproduce.

K/V loads are told apart from Q's, the block table's and the lengths' by the PTX line info:
every instruction follows a `.loc FILE LINE` naming the kernel source line it came from, and
the K and V loads are the instructions of the two `tl.load` lines that read k_ptr and v_ptr.

Compiles run in a subprocess (this file run as a script) with a fresh Triton cache, so ptxas
really runs, and with a per-configuration alarm: a runaway ptxas cannot hang the suite.
"""

import inspect
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
REGISTER_BUDGET = 128  # 4 warps at <= 128 registers keeps >= 4 programs per SM
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


def kernel_source_lines(kernel_fn, *needles):
    """The kernel-file line number of the one source line containing each needle."""
    lines, first = inspect.getsourcelines(kernel_fn)
    found = {}
    for needle in needles:
        hits = [first + i for i, line in enumerate(lines) if needle in line]
        assert len(hits) == 1, f"{needle!r} found on lines {hits}: update this check"
        found[needle] = hits[0]
    return found


def _access_bytes(instr: str):
    """Bytes moved per thread by a global load (ld.global or cp.async), None for anything else."""
    op = instr.split()[0]
    if op.startswith("cp.async.") and ".shared.global" in op:
        return int(re.search(r"\],\s*(0x[0-9a-fA-F]+|\d+)", instr).group(1), 0)
    if op.startswith("ld.global"):
        parts = op.split(".")
        vec = next((int(x[1:]) for x in parts if re.fullmatch(r"v\d+", x)), 1)
        return vec * int(re.fullmatch(r"[bufs](\d+)", parts[-1]).group(1)) // 8
    return None


def ptx_by_source_line(ptx: str, source_file: str) -> dict:
    """{kernel source line: [instructions]}, from the `.loc` directive each instruction follows.

    `.loc` lines of other files (Triton's standard library, inlined) map to line None.
    """
    files = {int(n): name for n, name in re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M)}
    kernel_files = {
        n for n, name in files.items() if Path(name).resolve() == Path(source_file).resolve()
    }
    assert kernel_files, f"no .file entry for {source_file}: PTX line info missing"
    by_line, line = {}, None
    for raw in ptx.splitlines():
        text = raw.strip()
        loc = re.match(r"\.loc\s+(\d+)\s+(\d+)", text)
        if loc:
            line = int(loc.group(2)) if int(loc.group(1)) in kernel_files else None
            continue
        text = re.sub(r"^@!?%\w+\s+", "", text)  # predicate guard
        if text and not text.startswith((".", "//", "$", "{", "}")):
            by_line.setdefault(line, []).append(text)
    return by_line


def compile_config(cfg):
    """Compiles one configuration exactly as the jax-triton path launches it; returns facts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pipelinerl_jax.kernels import paged_attention_triton as pt

    dtype, head_dim, kv_heads, group, page = cfg
    batch, pages, pages_per_seq = 64, 4096, 128
    params = pt.contiguous_launch_params(
        (batch, kv_heads * group, head_dim),
        (pages, kv_heads, page, head_dim),
        (batch, pages_per_seq),
        dtype=dtype,
        scale=head_dim**-0.5,
    )
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    kernel = pt.paged_decode_kernel
    pointer_args = kernel.arg_names[:6]  # q, k, v, block_tables, lengths, out (then constexprs)
    signature = {
        name: "*" + ("i32" if name in ("block_tables_ptr", "lengths_ptr") else TRITON_TYPES[dtype])
        for name in pointer_args
    }
    signature.update({name: "constexpr" for name in params.constexprs})
    assert list(signature) == kernel.arg_names, "kernel arguments changed: update this check"
    # jax-triton assumes every array is 16-byte aligned and says so to the compiler.
    attrs = {(i,): backend.parse_attr("D") for i in range(len(pointer_args))}
    compiled = triton.compile(
        ASTSource(kernel, signature, params.constexprs, attrs),
        target=target,
        options=dict(num_warps=params.num_warps, num_stages=params.num_stages),
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", cubin.name],
            capture_output=True,
            text=True,
            check=True,
            timeout=COMPILE_TIMEOUT_S,
        ).stdout
    fields = dict((k, int(v)) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    ptx = compiled.asm["ptx"]
    lines = kernel_source_lines(
        kernel.fn,
        "k_NxD = tl.load(k_ptr",
        "v_NxD = tl.load(v_ptr",
        "tl.dot(p_GPxN.to(v_NxD.dtype",
        "tl.store(out_ptr",
    )
    by_line = ptx_by_source_line(ptx, inspect.getsourcefile(kernel.fn))

    def load_bytes(line):
        return [n for n in map(_access_bytes, by_line.get(line, [])) if n is not None]

    def converts(line):
        return sorted({i.split()[0] for i in by_line.get(line, []) if i.startswith("cvt")})

    all_loads = [
        n for instrs in by_line.values() for n in map(_access_bytes, instrs) if n is not None
    ]
    return dict(
        registers=fields["REG"],
        stack=fields["STACK"],
        local=fields["LOCAL"],
        shared=int(compiled.metadata.shared),
        num_warps=params.num_warps,
        block_n=params.constexprs["BLOCK_N"],
        # Bytes per load instruction (cp.async when pipelined, else ld.global) of the K and V
        # tl.load lines only; Q, the block table and the lengths are other lines.
        k_load_bytes=load_bytes(lines["k_NxD = tl.load(k_ptr"]),
        v_load_bytes=load_bytes(lines["v_NxD = tl.load(v_ptr"]),
        loads_2b=sum(n <= 2 for n in all_loads),
        # Conversions emitted for `p_GPxN.to(v_NxD.dtype)` ahead of the probability x V dot,
        # and for the output's conversion to the cache dtype in the store.
        pv_converts=converts(lines["tl.dot(p_GPxN.to(v_NxD.dtype"]),
        store_converts=converts(lines["tl.store(out_ptr"]),
        kernel_name=compiled.metadata.name,
    )


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
    env = dict(
        os.environ,
        TRITON_CACHE_DIR=str(tmp / "cache"),
        TRITON_DEFAULT_FP_FUSION="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("TRITON_INTERPRET", None)
    env.pop("TRITON_DISABLE_LINE_INFO", None)  # the K/V load count reads the PTX line info
    proc = subprocess.Popen(
        [sys.executable, __file__, str(tmp / "out.json")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
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
        assert res["loads_2b"] == 0, f"scalar 2-byte loads in the kernel: {res}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=[_config_id(c) for c in CONFIGS])
def test_sm90_kv_loads_are_16_bytes(compiled, cfg):
    """Every load instruction of the K and V tl.load lines moves 16 bytes (8 bf16/f16 or 4 f32
    elements per thread), and there are enough of them to cover a [BLOCK_N, D] tile per step.

    Only K/V loads are counted (by PTX line info): Q's two 16-byte loads used to be counted
    with them, so a K/V path that fell back to narrow loads could still pass a total count.
    """
    res = compiled[_config_id(cfg)]
    assert "error" not in res, res.get("error")
    dtype, head_dim = cfg[0], cfg[1]
    itemsize = 4 if dtype == "float32" else 2
    threads = 32 * res["num_warps"]
    # One tile is BLOCK_N * D * itemsize bytes; 16 bytes per thread per instruction.
    per_tile = res["block_n"] * head_dim * itemsize // (16 * threads)
    for name in ("k_load_bytes", "v_load_bytes"):
        sizes = res[name]
        assert sizes and set(sizes) == {16}, f"{name}: K/V loads not all 16 bytes: {res}"
        assert len(sizes) >= per_tile, f"{name}: fewer 16-byte loads than one tile needs: {res}"


@pytest.mark.parametrize(
    "cfg",
    [c for c in CONFIGS if c[0] != "float32"],
    ids=[_config_id(c) for c in CONFIGS if c[0] != "float32"],
)
def test_sm90_16bit_conversions_round_to_nearest(compiled, cfg):
    """The compiled kernel converts the probabilities (before the P x V dot) and the output (in
    the store) to the cache dtype with cvt.rn, round to nearest even: the rounding that
    UPCAST_DOTS reproduces for bf16 in the interpreter (round_to_bf16_rne) and that the
    interpreter tests compare against."""
    res = compiled[_config_id(cfg)]
    assert "error" not in res, res.get("error")
    want = {"bfloat16": "cvt.rn.bf16x2.f32", "float16": "cvt.rn.f16x2.f32"}[cfg[0]]
    assert res["pv_converts"] == [want], res
    assert res["store_converts"] == [want], res


if __name__ == "__main__":
    _main(sys.argv[1])
