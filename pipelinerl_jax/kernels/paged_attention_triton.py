"""Triton paged decode-attention kernel and the one function that computes its launch.

`launch_params` is shared by every caller of the kernel (the jax-triton call on GPUs, the
interpreter tests with torch CPU tensors, the ahead-of-time sm_90 compile check), so the tested
configuration is the shipped one.

Dimension letters (pipelinerl_jax/__init__.py):
  B batch (sequences)     H query heads = K * G     K kv heads     G query heads per kv head
  D head dim              P pages in pool           S tokens per page     M pages per sequence
  N cache tokens per loop step (BLOCK_N)            GP = G padded for tl.dot (>= 16, power of 2)

Design (docs/triton_kernel.md has the measurements behind it):
- One program per (sequence, kv head). The G query heads sharing that kv head form one [GP, D]
  tile, so every K/V page is read once per group and the scores go through tl.dot.
- Online softmax in base 2 (scale * log2(e) folded into the scores), f32 accumulators.
- Strides and shapes are tl.constexpr: JAX shapes are static, and constexpr strides let the
  compiler prove 16-byte alignment of each K/V row (vector loads, fewer registers). The cache
  strides make [P, S, K, D] and [P, K, S, D] layouts both work; D must be contiguous.
- Page offsets are int64: P * page stride overflows int32 on large pools.
- Rows past a sequence's length are never loaded (masked loads), so garbage block-table entries
  and unwritten slots (NaN included) cannot leak in. A length of 0 gives zeros.
"""

import dataclasses
import math

import triton
import triton.language as tl

LOG2E = 1.4426950408889634

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# H100/H200 opt-in shared memory per block; triton.compile does not enforce it (launch would fail).
MAX_SHARED_BYTES = 232448


class PagedKernelConfigError(ValueError):
    """Raised when a shape or dtype cannot be served by the Triton kernel."""


@triton.jit
def round_to_bf16_rne(x):
    """f32 -> the nearest bf16 value (ties to even), kept in f32: what the GPU's f32 -> bf16
    conversion (cvt.rn) gives. Done on the bits because Triton 3.9's interpreter truncates on an
    f32 -> bf16 cast. Finite inputs only (the kernel's probabilities and outputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    lengths_ptr,
    out_ptr,
    SCALE_LOG2E: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_SB: tl.constexpr,
    Q_SH: tl.constexpr,
    KV_SP: tl.constexpr,
    KV_SS: tl.constexpr,
    KV_SK: tl.constexpr,
    BT_SB: tl.constexpr,
    O_SB: tl.constexpr,
    O_SH: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)

    g_GP = tl.arange(0, GP)
    d_D = tl.arange(0, D)
    n_N = tl.arange(0, BLOCK_N)
    g_valid_GP = g_GP < G
    head_GP = kv_head * G + g_GP

    q_off_GPxD = b.to(tl.int64) * Q_SB + head_GP[:, None] * Q_SH + d_D[None, :]
    q_GPxD = tl.load(q_ptr + q_off_GPxD, mask=g_valid_GP[:, None], other=0.0)
    if UPCAST_DOTS:
        q_GPxD = q_GPxD.to(tl.float32)

    # Positions past the block table's M pages do not exist (the reference agrees).
    length = tl.minimum(tl.load(lengths_ptr + b), M * PAGE)
    bt_row_ptr = block_tables_ptr + b.to(tl.int64) * BT_SB
    head_off = kv_head * KV_SK

    m_GP = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_GP = tl.zeros([GP], dtype=tl.float32)
    acc_GPxD = tl.zeros([GP, D], dtype=tl.float32)

    # Every step holds at least one valid token, so the running max is finite after step one.
    for start in range(0, length, BLOCK_N):
        pos_N = start + n_N
        valid_N = pos_N < length
        # One table read per token (cache-resident): garbage entries past the end stay masked.
        page_N = tl.load(bt_row_ptr + pos_N // PAGE, mask=valid_N, other=0).to(tl.int64)
        kv_off_NxD = (
            page_N[:, None] * KV_SP + (pos_N % PAGE)[:, None] * KV_SS + head_off + d_D[None, :]
        )
        k_NxD = tl.load(k_ptr + kv_off_NxD, mask=valid_N[:, None], other=0.0)
        v_NxD = tl.load(v_ptr + kv_off_NxD, mask=valid_N[:, None], other=0.0)
        if UPCAST_DOTS:
            k_NxD = k_NxD.to(tl.float32)
            v_NxD = v_NxD.to(tl.float32)

        if IEEE_DOT:
            s_GPxN = tl.dot(q_GPxD, tl.trans(k_NxD), input_precision="ieee")
        else:
            s_GPxN = tl.dot(q_GPxD, tl.trans(k_NxD))
        s_GPxN = tl.where(valid_N[None, :], s_GPxN * SCALE_LOG2E, float("-inf"))

        m_new_GP = tl.maximum(m_GP, tl.max(s_GPxN, axis=1))
        alpha_GP = tl.exp2(m_GP - m_new_GP)
        p_GPxN = tl.exp2(s_GPxN - m_new_GP[:, None])
        l_GP = l_GP * alpha_GP + tl.sum(p_GPxN, axis=1)
        if IEEE_DOT:
            pv_GPxD = tl.dot(p_GPxN, v_NxD, input_precision="ieee")
        elif UPCAST_DOTS:
            # The interpreter's stand-in for the bf16 dot below: the same rounding of the
            # probabilities to bf16, then an f32 dot (bf16 x bf16 products are exact in f32).
            pv_GPxD = tl.dot(round_to_bf16_rne(p_GPxN), v_NxD)
        else:
            pv_GPxD = tl.dot(p_GPxN.to(v_NxD.dtype), v_NxD)
        acc_GPxD = acc_GPxD * alpha_GP[:, None] + pv_GPxD
        m_GP = m_new_GP

    out_GPxD = acc_GPxD / tl.where(l_GP > 0, l_GP, 1.0)[:, None]
    if UPCAST_DOTS:
        if out_ptr.dtype.element_ty == tl.bfloat16:
            # Round to nearest as the GPU's store cast does (the interpreter's would truncate);
            # the cast below is then exact.
            out_GPxD = round_to_bf16_rne(out_GPxD)
    o_off_GPxD = b.to(tl.int64) * O_SB + head_GP[:, None] * O_SH + d_D[None, :]
    tl.store(out_ptr + o_off_GPxD, out_GPxD.to(out_ptr.dtype.element_ty), mask=g_valid_GP[:, None])


@dataclasses.dataclass(frozen=True)
class LaunchParams:
    """Everything a launcher needs besides the tensors: grid, compiler options, constexprs."""

    grid: tuple  # (B, K, 1): one program per (sequence, kv head)
    num_warps: int
    num_stages: int
    constexprs: dict  # kernel constexpr name -> value, passed as keyword arguments


def row_major_strides(shape) -> tuple:
    """Element strides of a contiguous row-major array (how JAX hands buffers to Triton)."""
    strides, acc = [], 1
    for size in reversed(tuple(shape)):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def launch_params(
    *,
    q_shape,
    q_strides,
    cache_shape,
    cache_strides,
    cache_layout="PSKD",
    block_tables_shape,
    block_tables_strides,
    out_strides,
    dtype: str,
    scale: float,
    interpret: bool = False,
) -> LaunchParams:
    """Grid, block sizes, warps, stages and constexprs for paged_decode_kernel.

    q is [B, H, D]; the cache is [P, S, K, D] ("PSKD") or [P, K, S, D] ("PKSD"); strides are in
    elements. `interpret` switches on UPCAST_DOTS for bf16, which Triton 3.9's interpreter needs:
    its bf16 dots multiply the raw bit patterns and its f32 -> bf16 casts truncate (loads and
    stores are right). Under the flag the dots take exactly upcast f32 operands and the
    probabilities and output are rounded to nearest-even bf16 on their bits where the compiled
    kernel converts them (cvt.rn), so the interpreter reproduces the shipped bf16 rounding.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise PagedKernelConfigError(
            f"paged_decode_kernel: dtype {dtype} unsupported; use one of {SUPPORTED_DTYPES}"
        )
    batch, num_heads, head_dim = q_shape
    if cache_layout == "PSKD":
        _, page_size, kv_heads, cache_d = cache_shape
        sp, ss, sk, sd = cache_strides
    elif cache_layout == "PKSD":
        _, kv_heads, page_size, cache_d = cache_shape
        sp, sk, ss, sd = cache_strides
    else:
        raise PagedKernelConfigError(
            f"paged_decode_kernel: cache_layout {cache_layout!r} must be 'PSKD' or 'PKSD'"
        )
    if cache_d != head_dim or num_heads % kv_heads:
        raise PagedKernelConfigError(
            f"paged_decode_kernel: q {tuple(q_shape)} does not fit cache {tuple(cache_shape)} "
            f"({cache_layout}); need equal head_dim and heads divisible by kv_heads"
        )
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise PagedKernelConfigError(
            f"paged_decode_kernel: head_dim {head_dim} must be a power of two >= 16 (tl.dot)"
        )
    if page_size % 16:
        raise PagedKernelConfigError(
            f"paged_decode_kernel: page_size {page_size} must be a multiple of 16"
        )
    if sd != 1 or q_strides[2] != 1 or out_strides[2] != 1 or block_tables_strides[1] != 1:
        raise PagedKernelConfigError(
            "paged_decode_kernel: the head_dim axis of q/cache/out and the page axis of "
            "block_tables must be contiguous (stride 1)"
        )
    group = num_heads // kv_heads
    # tl.dot needs M >= 16; padded query rows are masked on load and store.
    group_pad = max(16, triton.next_power_of_2(group))
    is_f32 = dtype == "float32"
    # 64 tokens per step for 16-bit caches, 32 for f32 (same bytes in flight, bounded registers).
    block_n = 32 if is_f32 else 64
    constexprs = dict(
        SCALE_LOG2E=float(scale) * LOG2E,
        G=group,
        GP=group_pad,
        D=head_dim,
        PAGE=page_size,
        M=block_tables_shape[1],
        BLOCK_N=block_n,
        Q_SB=q_strides[0],
        Q_SH=q_strides[1],
        KV_SP=sp,
        KV_SS=ss,
        KV_SK=sk,
        BT_SB=block_tables_strides[0],
        O_SB=out_strides[0],
        O_SH=out_strides[1],
        IEEE_DOT=is_f32,
        UPCAST_DOTS=bool(interpret and dtype == "bfloat16"),
    )
    return LaunchParams(grid=(batch, kv_heads, 1), num_warps=4, num_stages=2, constexprs=constexprs)


def contiguous_launch_params(
    q_shape, cache_shape, block_tables_shape, *, dtype: str, scale: float, interpret: bool = False
) -> LaunchParams:
    """launch_params for contiguous row-major [B,H,D] q/out, [P,K,S,D] cache: the JAX path."""
    if not math.isfinite(scale):
        raise PagedKernelConfigError(f"paged_decode_kernel: scale {scale} must be finite")
    return launch_params(
        q_shape=q_shape,
        q_strides=row_major_strides(q_shape),
        cache_shape=cache_shape,
        cache_strides=row_major_strides(cache_shape),
        cache_layout="PKSD",
        block_tables_shape=block_tables_shape,
        block_tables_strides=row_major_strides(block_tables_shape),
        out_strides=row_major_strides(q_shape),
        dtype=dtype,
        scale=scale,
        interpret=interpret,
    )
