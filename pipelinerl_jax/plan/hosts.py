"""Several hosts in the plan: whole hosts per role, and the weights' trip to every sampler host.

In a multi-host run (pipelinerl_jax/distributed/) each sampler process decodes on all of its
host's devices and the trainer processes train on all of theirs, so the generation devices I
and the training devices N − I come in whole hosts: multiples of `devices_per_host`.

After every optimizer step the trainer host serves the new weights, P bytes, to each of the
I / devices_per_host sampler hosts over its own link, of measured bandwidth W (bytes/s; the
profile's "weight_transfer": {"bytes_per_s": W}, as bench/bench_weight_transfer.py measures
it): the pulls of one version end after t_x = P · (I / devices_per_host) / W. Samplers never
wait for them (they keep decoding with the version they hold, see distributed/weights.py), so
the rate is unchanged, but tokens come from weights up to ceil(t_x / t_step) versions older,
t_step = B · L̄ / r being one optimizer step at rate r (tokens/s). That many steps are added to
each split's g_max before the lag bound picks the split, and a split whose transfers outlast a
step is reported as such.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pipelinerl_jax.plan.utilisation import PlanError


@dataclasses.dataclass(frozen=True)
class Hosts:
    """The machines: devices per host, and (optionally) the weights' transfer to each."""

    devices_per_host: int
    param_bytes: float = 0.0  # P, the weights one version moves
    transfer_bytes_per_s: float | None = None  # W; None: the transfer is not modelled

    def __post_init__(self):
        if self.devices_per_host < 1:
            raise PlanError(f"--devices_per_host={self.devices_per_host}: must be >= 1")
        if self.transfer_bytes_per_s is not None and self.transfer_bytes_per_s <= 0:
            raise PlanError(
                f"weight transfer bandwidth {self.transfer_bytes_per_s} bytes/s: must be "
                "positive (--transfer_gb_per_s, or the profile's weight_transfer.bytes_per_s)"
            )
        if self.transfer_bytes_per_s is not None and self.param_bytes <= 0:
            raise PlanError(
                "the weight transfer needs the weights' size: pass --param_bytes, or a "
                "profile whose decode.model records params and dtype"
            )

    def check(self, num_devices: int) -> None:
        """N must be whole hosts, at least one for each role."""
        d = self.devices_per_host
        if num_devices % d or num_devices < 2 * d:
            raise PlanError(
                f"--devices={num_devices} with --devices_per_host={d}: a multi-host layout "
                f"needs whole hosts, at least 2 (one trains, one samples); use a multiple "
                f"of {d} that is >= {2 * d}"
            )

    def gen_devices_ok(self, gen_devices: np.ndarray) -> np.ndarray:
        """Which generation-device counts are whole sampler hosts."""
        return gen_devices % self.devices_per_host == 0

    def transfer_s(self, gen_devices: np.ndarray) -> np.ndarray:
        """t_x for each I: P bytes to each of I / devices_per_host hosts through one link."""
        if self.transfer_bytes_per_s is None:
            return np.zeros_like(gen_devices, dtype=np.float64)
        hosts = gen_devices / self.devices_per_host
        return self.param_bytes * hosts / self.transfer_bytes_per_s

    def transfer_lag(
        self, r_pipe: np.ndarray, gen_devices: np.ndarray, batch_size: int, mean_len: float
    ) -> np.ndarray:
        """Extra versions of lag, ceil(t_x / t_step), for rates r_pipe [nH, nI] (tokens/s)."""
        step_s = batch_size * mean_len / np.maximum(r_pipe, 1e-300)
        ratio = self.transfer_s(gen_devices)[None, :] / step_s
        return np.ceil(ratio - 1e-12).astype(np.int64)


def apply(grid, hosts: Hosts, *, num_devices: int, batch_size: int, mean_len: float):
    """The PipelineGrid restricted to whole-host splits, with the transfer lag added."""
    hosts.check(num_devices)
    keep = hosts.gen_devices_ok(grid.gen_devices)
    if not keep.any():
        raise PlanError(f"no whole-host split of {num_devices} devices")
    grid = grid.keep_gen_devices(keep)
    extra = hosts.transfer_lag(grid.r_pipe_HxI, grid.gen_devices, batch_size, mean_len)
    return dataclasses.replace(grid, lag_HxI=grid.lag_HxI + extra)


def describe(
    hosts: Hosts, gen_devices: int, devices: int, r: float, batch_size: int, mean_len: float
) -> str:
    """One line for the plan table: hosts per role and what the transfer costs."""
    d = hosts.devices_per_host
    line = f"hosts: {gen_devices // d} sampling, {(devices - gen_devices) // d} training ({d} devices each)"
    if hosts.transfer_bytes_per_s is None:
        return line + "; weight transfer not modelled (give its bandwidth)"
    t_x = float(hosts.transfer_s(np.array([gen_devices]))[0])
    step = batch_size * mean_len / r
    lag = math.ceil(t_x / step - 1e-12)
    return (
        f"{line}; weights {hosts.param_bytes / 1e6:.3g} MB to each sampler host at "
        f"{hosts.transfer_bytes_per_s / 1e9:.3g} GB/s: {t_x:.3g} s per version, "
        f"{t_x / step:.2f} of a {step:.3g} s step (+{lag} lag)"
    )
