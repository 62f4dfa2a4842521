"""NVIDIA GPUs the planner and the ahead-of-time compiler know: published rates and XLA targets.

`GpuSpec` holds what a roofline needs (dense matmul peaks, HBM bandwidth, memory per device)
and `target_config()` writes the XLA `GpuTargetConfigProto` text that
`jax.experimental.topologies.get_topology_desc(..., "cuda", target_config=...)` takes to
compile for that GPU on a machine without one. The proto holds only fields that jax 0.11's
XLA parses (the thread/block limits, shared memory, core count, bandwidth, L2, clock, memory,
registers and the compute capability); newer XLA specs carry more, which older parsers reject.

Peaks are the vendor's dense (no sparsity) figures for the SXM parts: H100 SXM 989 TFLOP/s
bf16, 67 TFLOP/s f32 (non-tensor core; 495 with TF32 tensor cores), 3.35 TB/s HBM3;
H200 the same compute with 4.8 TB/s HBM3e.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GPUS", "GpuSpec", "gpu_spec"]


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU model: published peaks and the device facts the XLA target needs."""

    name: str  # key: "h100", "h200"
    device_kind: str  # what jax.devices()[0].device_kind says on the real GPU
    memory_bytes: int  # HBM per device as CUDA reports it
    hbm_bytes_per_s: float  # peak memory bandwidth
    bf16_flops: float  # dense bf16 tensor-core peak
    tf32_flops: float  # dense tf32 tensor-core peak (XLA's default f32 matmul precision)
    f32_flops: float  # non-tensor-core f32 peak
    core_count: int
    l2_bytes: int
    clock_ghz: float
    compute_capability: int = 90  # sm_90

    def matmul_flops(self, dtype: str) -> float:
        """Dense matmul peak for operands of `dtype` (f32 matmuls run as tf32 under XLA's
        default precision on Hopper)."""
        return self.bf16_flops if dtype in ("bfloat16", "float16") else self.tf32_flops

    def target_config(self) -> str:
        """XLA GpuTargetConfigProto text for deviceless compilation."""
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.hbm_bytes_per_s)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {self.compute_capability // 10} minor: {self.compute_capability % 10} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{self.device_kind}"
"""


GPUS = {
    "h100": GpuSpec(
        name="h100",
        device_kind="NVIDIA H100 80GB HBM3",
        memory_bytes=84_942_979_072,
        hbm_bytes_per_s=3.35e12,
        bf16_flops=989e12,
        tf32_flops=494.5e12,
        f32_flops=66.9e12,
        core_count=132,
        l2_bytes=52_428_800,
        clock_ghz=1.98,
    ),
    "h200": GpuSpec(
        name="h200",
        device_kind="NVIDIA H200 141GB HBM3e",
        memory_bytes=151_397_597_184,
        hbm_bytes_per_s=4.8e12,
        bf16_flops=989e12,
        tf32_flops=494.5e12,
        f32_flops=66.9e12,
        core_count=132,
        l2_bytes=52_428_800,
        clock_ghz=1.98,
    ),
}


def gpu_spec(name: str) -> GpuSpec:
    """The named GPU; ValueError naming the known ones otherwise."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}: known GPUs are {sorted(GPUS)}") from None
