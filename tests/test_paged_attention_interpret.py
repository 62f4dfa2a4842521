"""The Triton paged decode kernel under Triton's interpreter, against the jnp reference.

TRITON_INTERPRET=1 only takes effect if set before the kernel is decorated, and other test
modules import Triton normally, so every case runs in one subprocess: this file run as a script
(`python tests/test_paged_attention_interpret.py OUT.json`) executes all cases with torch CPU
tensors and writes each case's errors; the pytest side checks them one by one.

Every unused cache slot, every block-table entry past a sequence's pages and every table slot
past the M columns the kernel is given (the table rows are views into wider storage) points at
NaN, so a stray read fails the case instead of passing silently. Launch parameters come from
`launch_params`, the function the jax-triton call uses.

bf16 under the interpreter: Triton 3.9's interpreter multiplies bf16 dot operands as their raw
16-bit patterns and truncates f32 -> bf16 casts (the GPU rounds to nearest even), so
launch_params sets UPCAST_DOTS when interpreting bf16: the dots run in f32 on the exactly
upcast operands, and the probabilities (and the bf16 output) are rounded to nearest-even bf16
on their bits exactly where the compiled kernel converts them (the sm_90 compile test checks
that the compiled conversion is cvt.rn). So the bf16 numerics the GPU ships, rounding
included, are compared against a reference that rounds the same way, to a tight tolerance.
"""

import functools
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE, PAGES_PER_SEQ, EXTRA_PAGES = 16, 8, 3
MAX_LEN = PAGES_PER_SEQ * PAGE  # M * S positions in every case's block table
TABLE_PAD = 2  # stored table columns past the M the kernel sees (NaN pages)
# Lengths 0, 1, partial last page, past the table (clamped to M * S: reading on would hit the
# NaN pad columns), exact pages, the maximum; several loop steps.
LENGTHS = (0, 1, 37, MAX_LEN + 45, 48, MAX_LEN)
# Kernel (output in the case dtype) against the reference with f32 probabilities. Loose for
# 16-bit, about 2-3x the bound: the output is stored in the case dtype (half a spacing is 2^-7
# in bf16, 2^-10 in fp16 for |out| in [2, 4); |out| < 4 here) and the kernel rounds its
# probabilities (moves outputs by up to 1.5e-3 in bf16, 2e-4 in fp16 here); the tight 16-bit
# checks are the rounded-reference tests below.
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 2e-2}
# Kernel with an f32 output buffer against the reference that rounds the probabilities the same
# way and blocks the online softmax like the kernel (BLOCK_N tokens per step): what is left is
# f32 rounding (scores summed in another order, exp2 vs exp), and now and then a probability
# that lands on the other side of a 16-bit rounding boundary because of it. Measured on these
# inputs: mean |error| 1e-8 to 1.2e-7, max 2e-7 to 5e-7 for bf16 and up to 4e-5 for fp16 (a
# boundary flip moves a whole output row by ulp(p) * v / l). The rounding itself moves the
# reference by a mean of >= 1.2e-4 (bf16) and >= 1.5e-5 (fp16), max >= 8e-4 (bf16).
# The mean is the tight, discriminating check (flips hardly move it): ROUNDING_MARGIN x its
# tolerance must stay below the rounding's effect, asserted per case. The max bound only
# catches a few rows going wrong; it allows flips, so it is tight against the bf16 rounding
# (8x below its effect) but not against fp16's.
ROUNDED_MEAN_TOLERANCE = 5e-7
ROUNDED_MAX_TOLERANCE = 1e-4
ROUNDING_MARGIN = 20


def _case(dtype, group, head_dim, layout, kv_heads=2, page=PAGE):
    return dict(
        id=f"{dtype}-G{group}-D{head_dim}-K{kv_heads}-{layout}-S{page}",
        dtype=dtype,
        group=group,
        head_dim=head_dim,
        layout=layout,
        kv_heads=kv_heads,
        page=page,
    )


CASES = (
    [
        _case(dt, g, 64, "PSKD")
        for dt, g in itertools.product(("float32", "bfloat16", "float16"), (1, 4, 8))
    ]
    + [
        _case("float32", 4, 64, "PKSD"),
        _case("bfloat16", 8, 64, "PKSD"),
        _case("float16", 1, 64, "PKSD"),
    ]
    + [
        _case(dt, g, 128, "PSKD")
        for dt, g in itertools.product(("float32", "bfloat16", "float16"), (4, 8))
    ]
    + [
        _case("bfloat16", 2, 64, "PKSD", kv_heads=4, page=32),
        _case("float32", 2, 64, "PSKD", kv_heads=4, page=32),
    ]
    # Page size 64 (as the sm_90 bf16-D128-S64 configuration): one page per 64-token step.
    + [
        _case("bfloat16", 4, 64, "PKSD", page=64),
        _case("float16", 8, 64, "PSKD", page=64),
        _case("float32", 4, 64, "PKSD", page=64),
    ]
)
ROUNDED_CASES = [c for c in CASES if c["dtype"] != "float32"]


def make_inputs(case, seed):
    """Random q/cache/tables (numpy f32 values exactly representable in the case dtype).

    The block table comes back as [B, M + TABLE_PAD] storage; the kernel is handed the [B, M]
    view (row stride M + TABLE_PAD), the reference a copy of it.
    """
    import ml_dtypes

    rng = np.random.default_rng(seed)
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[
        case["dtype"]
    ]
    kv_heads, group, head_dim, page = (
        case["kv_heads"],
        case["group"],
        case["head_dim"],
        case["page"],
    )
    pages_per_seq = MAX_LEN // page
    batch = len(LENGTHS)
    num_pages = batch * pages_per_seq + EXTRA_PAGES

    def rand(*shape):
        return rng.standard_normal(shape).astype(np_dtype).astype(np.float32)

    q_BxHxD = rand(batch, kv_heads * group, head_dim)
    # The engine's layout [P, K, S, D]; PSKD cases hand the kernel a transposed copy.
    k_PxKxSxD = rand(num_pages, kv_heads, page, head_dim)
    v_PxKxSxD = rand(num_pages, kv_heads, page, head_dim)
    nan_pages = np.arange(batch * pages_per_seq, num_pages)
    k_PxKxSxD[nan_pages] = np.nan
    v_PxKxSxD[nan_pages] = np.nan
    owned = rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)
    block_tables = rng.choice(nan_pages, size=(batch, pages_per_seq + TABLE_PAD)).astype(np.int32)
    for b, length in enumerate(LENGTHS):
        used = min(-(-length // page), pages_per_seq)
        block_tables[b, :used] = owned[b, :used]
        # Slots past the length inside the sequence's pages were never written.
        for pos in range(length, pages_per_seq * page):
            k_PxKxSxD[owned[b, pos // page], :, pos % page] = np.nan
            v_PxKxSxD[owned[b, pos // page], :, pos % page] = np.nan
    lengths_B = np.asarray(LENGTHS, np.int32)
    return q_BxHxD, k_PxKxSxD, v_PxKxSxD, block_tables, lengths_B


def _max_err(got, want):
    return float(np.nan_to_num(np.abs(got - want), nan=np.inf).max())


@functools.cache
def _references():
    """The jitted references, built once: cases with equal shapes share a compile."""
    import jax

    from pipelinerl_jax.kernels.paged_attention_ref import paged_decode_attention_ref

    def rounded_and_not(q, k, v, bt, lengths, *, scale, pages_per_step, dtype):
        ref = functools.partial(
            paged_decode_attention_ref,
            q,
            k,
            v,
            bt,
            lengths,
            scale=scale,
            pages_per_step=pages_per_step,
        )
        return ref(round_probs_dtype=dtype), ref()

    return (
        jax.jit(paged_decode_attention_ref, static_argnames="scale"),
        jax.jit(rounded_and_not, static_argnames=("scale", "pages_per_step", "dtype")),
    )


def run_case(case, *, seed=0):
    """Runs the kernel in the interpreter; returns its errors against the references.

    16-bit cases run the kernel twice, storing to the case dtype (shipped) and to f32 (the
    result before the output rounding), and compare with the reference blocked like the kernel
    (BLOCK_N tokens per online-softmax step) with and without the probability rounding.
    """
    import ml_dtypes
    import torch

    from pipelinerl_jax.kernels import paged_attention_triton as pt

    q, k, v, bt_storage, lengths = make_inputs(case, seed)
    pages_per_seq = MAX_LEN // case["page"]
    bt = np.ascontiguousarray(bt_storage[:, :pages_per_seq])
    scale = case["head_dim"] ** -0.5
    torch_dtype = getattr(torch, case["dtype"])
    q_t = torch.from_numpy(q).to(torch_dtype)
    k_t, v_t = (torch.from_numpy(x).to(torch_dtype) for x in (k, v))
    if case["layout"] == "PSKD":
        # Same values, [P, S, K, D] storage: the kernel only sees different strides.
        k_t, v_t = (x.transpose(1, 2).contiguous() for x in (k_t, v_t))
    bt_t = torch.from_numpy(bt_storage)[:, :pages_per_seq]  # a view: row stride M + TABLE_PAD
    len_t = torch.from_numpy(lengths)

    def launch(out_dtype):
        out_t = torch.full(q_t.shape, float("nan"), dtype=out_dtype)
        params = pt.launch_params(
            q_shape=tuple(q_t.shape),
            q_strides=q_t.stride(),
            cache_shape=tuple(k_t.shape),
            cache_strides=k_t.stride(),
            cache_layout=case["layout"],
            block_tables_shape=tuple(bt_t.shape),
            block_tables_strides=bt_t.stride(),
            out_strides=out_t.stride(),
            dtype=case["dtype"],
            scale=scale,
            interpret=True,
        )
        pt.paged_decode_kernel[params.grid](
            q_t,
            k_t,
            v_t,
            bt_t,
            len_t,
            out_t,
            num_warps=params.num_warps,
            num_stages=params.num_stages,
            **params.constexprs,
        )
        return out_t.float().numpy(), params

    start = time.perf_counter()
    out, params = launch(torch_dtype)  # the shipped output dtype
    res = dict(
        zero_len_zeros=bool(np.all(out[0] == 0)), upcast_dots=params.constexprs["UPCAST_DOTS"]
    )
    plain_ref, rounded_and_not = _references()
    if case["dtype"] == "float32":
        ref = np.asarray(plain_ref(q, k, v, bt, lengths, scale=scale))
    else:
        block_n = params.constexprs["BLOCK_N"]
        assert block_n % case["page"] == 0, "the reference blocks by whole pages"
        # One compile for both (the XLA compile is most of a case's time).
        ref_rounded, ref = (
            np.asarray(x)
            for x in rounded_and_not(
                q,
                k,
                v,
                bt,
                lengths,
                scale=scale,
                pages_per_step=block_n // case["page"],
                dtype=case["dtype"],
            )
        )
        out_f32, _ = launch(torch.float32)
        np_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[case["dtype"]]
        res.update(
            rounded_max_err=_max_err(out_f32, ref_rounded),
            rounded_mean_err=float(np.abs(out_f32 - ref_rounded).mean()),
            rounding_max_effect=_max_err(ref_rounded, ref),
            rounding_mean_effect=float(np.abs(ref_rounded - ref).mean()),
            unrounded_mean_err=float(np.abs(out_f32 - ref).mean()),
            # The stored output against the same kernel's f32 result rounded to nearest even.
            store_mismatches=int(np.sum(out != out_f32.astype(np_dtype).astype(np.float32))),
        )
    res.update(
        max_err=_max_err(out, ref),
        ref_max=float(np.abs(ref).max()),
        seconds=time.perf_counter() - start,
    )
    return res


def probe_interpreter_bf16(seed=0):
    """Facts about the interpreter's bf16 handling, on fresh random values, with tiny kernels.

    - dot: does tl.dot of two bf16 tiles equal the integer product of their bit patterns?
    - cast: is the interpreter's f32 -> bf16 cast truncation, not round-to-nearest?
    - round_to_bf16_rne (the kernel's stand-in for the GPU conversion) against ml_dtypes'
      round-to-nearest-even, on random values and on exact ties.
    Script-only: the probe kernels are defined in the `__main__` block at the end of the file.
    """
    import ml_dtypes
    import torch

    rng = np.random.default_rng(seed)
    n = 16
    a_t, b_t = (
        torch.from_numpy(rng.standard_normal((n, n)).astype(np.float32)).to(torch.bfloat16)
        for _ in range(2)
    )
    c_t = torch.full((n, n), float("nan"))
    _dot_kernel[(1,)](a_t, b_t, c_t, N=n)
    c = c_t.numpy().astype(np.float64)
    true = a_t.float().numpy().astype(np.float64) @ b_t.float().numpy().astype(np.float64)
    bits_a, bits_b = (
        x.view(torch.int16).numpy().view(np.uint16).astype(np.float64) for x in (a_t, b_t)
    )
    as_ints = bits_a @ bits_b

    m = 4096
    x = rng.uniform(-4, 4, m).astype(np.float32)
    # Exact ties: a bf16 value plus half its spacing; both even and odd last bits occur.
    base = x[:256].astype(ml_dtypes.bfloat16).astype(np.float32)
    ties = (base.view(np.uint32) | np.uint32(0x8000)).view(np.float32)
    x = np.concatenate([x[256:], ties])
    x_t = torch.from_numpy(x)
    cast_t = torch.empty(m, dtype=torch.bfloat16)
    rne_t = torch.full((m,), float("nan"))
    _cast_kernel[(1,)](x_t, cast_t, rne_t, N=m)
    want_rne = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    truncated = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    cast = cast_t.float().numpy()
    return dict(
        dot_rel_err_vs_bit_patterns=float(np.abs(c - as_ints).max() / np.abs(as_ints).max()),
        dot_err_vs_true=float(np.abs(c - true).max()),
        dot_true_max=float(np.abs(true).max()),
        cast_equals_truncation=bool(np.array_equal(cast, truncated)),
        cast_differs_from_rne=int(np.sum(cast != want_rne)),
        rne_mismatches=int(np.sum(rne_t.numpy() != want_rne)),
        rne_ties_rounded_up=int(np.sum(np.abs(rne_t.numpy()[-256:]) > np.abs(base))),
    )


def _main(out_path):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 before running this file")
    results = {c["id"]: run_case(c) for c in CASES}
    results["probe"] = probe_interpreter_bf16()
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("interp") / "results.json"
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        JAX_PLATFORMS="cpu",
        TRITON_DEFAULT_FP_FUSION="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_kernel_matches_reference(interpreter_results, case):
    """Kernel (shipped output dtype) matches the f32-probability reference: masking, the length
    clamp, GQA grouping, both cache layouts, page sizes 16/32/64, zeros for length 0."""
    res = interpreter_results[case["id"]]
    assert 0.1 < res["ref_max"] < 4  # random inputs, not zeros; |out| < 4 bounds TOLERANCE
    assert res["zero_len_zeros"], "a length-0 sequence must give exact zeros"
    assert res["upcast_dots"] == (case["dtype"] == "bfloat16"), res
    assert res["max_err"] <= TOLERANCE[case["dtype"]], res


@pytest.mark.parametrize("case", ROUNDED_CASES, ids=[c["id"] for c in ROUNDED_CASES])
def test_16bit_kernel_rounds_probabilities_like_the_compiled_kernel(interpreter_results, case):
    """With an f32 output buffer the kernel matches the reference that rounds each step's
    probabilities to the cache dtype (nearest even) before the P x V dot, to a mean error of
    ROUNDED_MEAN_TOLERANCE; that rounding moves the reference (and a kernel that skipped it) by
    more than ROUNDING_MARGIN x the tolerance, so a kernel that did not round, or truncated,
    fails. For bf16 this is the UPCAST_DOTS path, whose rounding the sm_90 compile test ties
    to the compiled cvt.rn conversion."""
    res = interpreter_results[case["id"]]
    margin = ROUNDING_MARGIN * ROUNDED_MEAN_TOLERANCE
    assert res["rounding_mean_effect"] > margin, f"inputs too tame to see the rounding: {res}"
    assert res["unrounded_mean_err"] > margin, res
    assert res["rounded_mean_err"] <= ROUNDED_MEAN_TOLERANCE, res
    assert res["rounded_max_err"] <= ROUNDED_MAX_TOLERANCE, res


@pytest.mark.parametrize("case", ROUNDED_CASES, ids=[c["id"] for c in ROUNDED_CASES])
def test_16bit_output_is_stored_rounded_to_nearest(interpreter_results, case):
    """The stored 16-bit output is exactly the kernel's f32 result rounded to nearest even (the
    GPU's cvt.rn store, checked in the sm_90 compile test); a truncating store, which the
    interpreter's bf16 cast is, differs in about half of the elements."""
    res = interpreter_results[case["id"]]
    assert res["store_mismatches"] == 0, res


def test_interpreter_bf16_dot_still_multiplies_bit_patterns(interpreter_results):
    """Triton 3.9's interpreter computes a bf16 x bf16 tl.dot as the product of the operands'
    raw 16-bit patterns read as integers: the reason for UPCAST_DOTS.

    This replaces a check that the native-bf16 kernel merely disagreed with the reference
    (which any bf16 bug would satisfy): it checks this specific failure on a bare tl.dot, the
    only bf16 arithmetic the kernel does. If it fails, the interpreter got fixed: run the
    native bf16 dots in the interpreter (drop UPCAST_DOTS from launch_params) and this test.
    """
    probe = interpreter_results["probe"]
    assert probe["dot_rel_err_vs_bit_patterns"] < 1e-6, probe
    assert probe["dot_err_vs_true"] > 0.1 * probe["dot_true_max"] > 0, probe


def test_interpreter_bf16_cast_still_truncates(interpreter_results):
    """Triton 3.9's interpreter truncates f32 -> bf16 casts (the GPU rounds to nearest even):
    the reason round_to_bf16_rne rounds on the bits. If this fails the interpreter got fixed and
    a plain cast would do (round_to_bf16_rne stays correct either way)."""
    probe = interpreter_results["probe"]
    assert probe["cast_equals_truncation"] and probe["cast_differs_from_rne"] > 1000, probe


def test_round_to_bf16_rne_is_round_to_nearest_even(interpreter_results):
    """round_to_bf16_rne (run in the interpreter) equals ml_dtypes' round-to-nearest-even on
    random values and on exact ties, which go to the even neighbour (up about half the time)."""
    probe = interpreter_results["probe"]
    assert probe["rne_mismatches"] == 0, probe
    assert 50 < probe["rne_ties_rounded_up"] < 206, probe


if __name__ == "__main__":
    # The probe kernels exist only in the interpreter subprocess; the interpreter resolves the
    # names a kernel calls among module globals, hence defined here rather than in the probe.
    import triton
    import triton.language as tl

    from pipelinerl_jax.kernels.paged_attention_triton import round_to_bf16_rne

    @triton.jit
    def _dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        idx = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
        tl.store(c_ptr + idx, tl.dot(tl.load(a_ptr + idx), tl.load(b_ptr + idx)))

    @triton.jit
    def _cast_kernel(x_ptr, cast_ptr, rne_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i)
        tl.store(cast_ptr + i, x.to(tl.bfloat16))
        tl.store(rne_ptr + i, round_to_bf16_rne(x))

    _main(sys.argv[1])
