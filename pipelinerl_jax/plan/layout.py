"""How to split devices between generation and training: the talk's layout invariants, solved.

The talk (Applied Compute, "Efficient Reinforcement Learning") states two invariants for an
asynchronous RL layout: (1) training token consumption rate == inference token production rate;
(2) the maximum theoretical staleness must not exceed what the algorithm tolerates. Its inputs:
number of devices, training batch size, sampling throughput (bounded by KV-cache memory and the
forward latency per batch size), and training throughput per device.

This is the paper's Appendix A search in measured units: a device generating at batch H produces
H / latency(H) tokens/s (the curve plays U's role), a training device consumes T tokens/s
(τ = 1/T), and the staleness bound is the paper's g_max. `plan_layout` returns the split that
maximises min(production, consumption) under the bound, with predicted throughput, lag and the
idle fraction of each side, plus Conventional RL at the same lag for comparison. The same code
answers in the paper's units (tokens per flash) when handed a U(h) curve and τ in flashes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pipelinerl_jax.plan import hosts as hosts_lib
from pipelinerl_jax.plan import model
from pipelinerl_jax.plan.utilisation import UNIT_FRACTION, PlanError, UtilisationCurve


def kv_cache_max_batch(
    *,
    memory_bytes: float,
    param_bytes: float,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    context_len: int,
    bytes_per_element: int = 2,
    reserve_fraction: float = 0.1,
) -> int:
    """Sequences of `context_len` tokens whose K and V fit beside the weights on one device.

    Per token the cache holds 2 (K and V) · layers · kv_heads · head_dim elements; a fraction
    `reserve_fraction` of memory is kept for activations and the compiler's scratch.
    """
    per_seq = 2 * num_layers * num_kv_heads * head_dim * bytes_per_element * context_len
    free = memory_bytes * (1.0 - reserve_fraction) - param_bytes
    if per_seq <= 0:
        raise PlanError("KV bound: layers, kv heads, head_dim and context_len must be positive")
    if free < per_seq:
        raise PlanError(
            f"KV bound: {memory_bytes / 2**30:.2f} GiB per device leaves "
            f"{max(free, 0) / 2**30:.2f} GiB after weights, less than one "
            f"{context_len}-token sequence ({per_seq / 2**30:.3f} GiB); shard the "
            "weights, shorten the context or use larger devices"
        )
    return int(free // per_seq)


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What one device can do: generation rate vs batch, training time per token, memory bound."""

    gen_curve: UtilisationCurve  # per-device generation rate vs per-device batch
    tau: float  # training time per token on one device (flashes or seconds)
    max_gen_batch: float | None = None  # KV-cache bound on the per-device batch

    @property
    def unit(self) -> str:
        return "tokens/flash" if self.gen_curve.unit == UNIT_FRACTION else "tokens/s"

    @classmethod
    def from_measurements(
        cls,
        *,
        decode_batch_sizes,
        decode_latency_s,
        train_tokens_per_s_per_device: float,
        max_gen_batch: float | None = None,
        source: str = "",
    ) -> DeviceProfile:
        """The talk's inputs: decode latency per batch size and training tokens/s per device."""
        if train_tokens_per_s_per_device <= 0:
            raise PlanError(
                f"train tokens/s per device must be positive, got {train_tokens_per_s_per_device}"
            )
        curve = UtilisationCurve.from_decode_latency(
            decode_batch_sizes, decode_latency_s, source=source
        )
        return cls(curve, 1.0 / train_tokens_per_s_per_device, max_gen_batch)


@dataclasses.dataclass(frozen=True)
class Workload:
    devices: int  # N
    batch_size: int  # B, sequences per optimizer step
    lengths: model.LengthDistribution
    max_lag: int  # the staleness the algorithm tolerates, in optimizer steps
    hosts: hosts_lib.Hosts | None = None  # several hosts: whole hosts per role, transfer


@dataclasses.dataclass(frozen=True)
class Plan:
    """A recommended layout and the model's predictions for it (rates in `unit`)."""

    unit: str
    devices: int
    gen_devices: int  # I
    gen_batch: float  # H, sequences decoding at once on each generation device
    r_gen: float  # production, U(H)·I
    r_train: float  # consumption, (N − I)/τ
    r: float  # predicted throughput, min of the two
    lag: int  # g_max of this layout
    max_lag: int  # the bound it was chosen under
    gen_idle: float  # fraction of time generation devices wait for the trainer
    train_idle: float  # fraction of time training devices wait for data
    samples_rate: float  # sequences per time unit, r / L̄
    steps_rate: float  # optimizer steps per time unit, r / (L̄·B)
    conventional: dict  # Conventional RL at G = max_lag + 1 (same lag), or {} if not asked
    speedup: float  # r / r_conv (nan without the comparison)
    transfer_s: float = 0.0  # seconds to move one version to every sampler host (hosts.py)
    transfer_lag: int = 0  # versions that transfer adds to lag (included in `lag`)

    @property
    def train_devices(self) -> int:
        return self.devices - self.gen_devices


def _check_fixed(workload: Workload, prof: DeviceProfile, gen_devices, gen_batch) -> None:
    n = workload.devices
    if gen_devices is not None and not 1 <= gen_devices <= n - 1:
        raise PlanError(
            f"--gen_devices={gen_devices}: with --devices={n} it must be in 1..{n - 1} "
            "(at least one device has to train and one to generate)"
        )
    if gen_batch is not None:
        bound = prof.gen_curve.max_batch
        if prof.max_gen_batch is not None and gen_batch > prof.max_gen_batch:
            raise PlanError(
                f"--gen_batch={gen_batch:g}: exceeds the KV-cache bound of "
                f"{prof.max_gen_batch:g} sequences per device; use <= "
                f"{math.floor(prof.max_gen_batch)}"
            )
        if gen_batch > bound or gen_batch <= 0:
            raise PlanError(
                f"--gen_batch={gen_batch:g}: the profile measures batch sizes up to "
                f"{bound:g}; use 1..{math.floor(bound)} or re-measure with larger "
                "--batch_sizes"
            )


def plan_layout(
    prof: DeviceProfile,
    workload: Workload,
    *,
    gen_devices: int | None = None,
    gen_batch: float | None = None,
    compare_conventional: bool = True,
) -> Plan:
    """The best (H, I) under workload.max_lag, optionally with I and/or H fixed by the user."""
    if workload.max_lag < 0:
        raise PlanError(f"--max_lag={workload.max_lag}: must be >= 0 optimizer steps")
    _check_fixed(workload, prof, gen_devices, gen_batch)
    grid = model.pipeline_grid(
        prof.gen_curve,
        workload.lengths,
        num_devices=workload.devices,
        batch_size=workload.batch_size,
        tau=prof.tau,
        max_gen_batch=prof.max_gen_batch,
        gen_batches=None if gen_batch is None else [gen_batch],
    )
    if gen_devices is not None:
        grid = grid.keep_gen_devices(grid.gen_devices == gen_devices)
    grid = _with_hosts(grid, prof, workload)
    choice = model.best_pipeline(grid, workload.max_lag)
    mean_len = workload.lengths.mean_len
    transfer_s, transfer_lag = 0.0, 0
    if workload.hosts is not None:
        transfer_s = float(workload.hosts.transfer_s(np.array([choice.gen_devices]))[0])
        transfer_lag = int(
            workload.hosts.transfer_lag(
                np.array([[choice.r_pipe]]),
                np.array([choice.gen_devices]),
                workload.batch_size,
                mean_len,
            )[0, 0]
        )
    conv, speedup = {}, float("nan")
    if compare_conventional:
        conv = model.conventional_rate_at_lag(
            prof.gen_curve,
            workload.lengths,
            num_devices=workload.devices,
            batch_size=workload.batch_size,
            tau=prof.tau,
            max_lag=workload.max_lag,
            max_batch=prof.max_gen_batch,
        )
        conv["gen_time_fraction"] = conv["r"] / conv["r_gen"]
        conv["train_time_fraction"] = conv["r"] / conv["r_train"]
        speedup = choice.r_pipe / conv["r"]
    return Plan(
        unit=prof.unit,
        devices=workload.devices,
        gen_devices=choice.gen_devices,
        gen_batch=choice.gen_batch,
        r_gen=choice.r_gen,
        r_train=choice.r_train,
        r=choice.r_pipe,
        lag=choice.max_lag,
        max_lag=workload.max_lag,
        gen_idle=1.0 - choice.r_pipe / choice.r_gen,
        train_idle=1.0 - choice.r_pipe / choice.r_train,
        samples_rate=choice.r_pipe / mean_len,
        steps_rate=choice.r_pipe / (mean_len * workload.batch_size),
        conventional=conv,
        speedup=speedup,
        transfer_s=transfer_s,
        transfer_lag=transfer_lag,
    )


def _with_hosts(grid, prof: DeviceProfile, workload: Workload):
    """The grid over whole-host splits with the weight transfer's lag (hosts.py), if any."""
    if workload.hosts is None:
        return grid
    if workload.hosts.transfer_bytes_per_s is not None and prof.unit != "tokens/s":
        raise PlanError(
            "the weight transfer is timed in seconds: plan in seconds mode (--units=seconds "
            "with a measured profile) or leave the transfer bandwidth out"
        )
    return hosts_lib.apply(
        grid,
        workload.hosts,
        num_devices=workload.devices,
        batch_size=workload.batch_size,
        mean_len=workload.lengths.mean_len,
    )


def lag_sweep(prof: DeviceProfile, workload: Workload, max_lags) -> dict[str, np.ndarray]:
    """Best PipelineRL rate and Conventional RL rate for each lag bound (the paper's Figure 8).

    Conventional is NaN beyond the lags whose rounds the profile covers (no extrapolation)."""
    lags = np.asarray(max_lags, dtype=np.int64)
    grid = model.pipeline_grid(
        prof.gen_curve,
        workload.lengths,
        num_devices=workload.devices,
        batch_size=workload.batch_size,
        tau=prof.tau,
        max_gen_batch=prof.max_gen_batch,
    )
    pipe = model.best_rate_by_lag(_with_hosts(grid, prof, workload), lags)
    covered = conventional_lag_covered(prof, workload)
    conv = np.array(
        [  # NaN where the profile does not reach the round's per-device batch
            model.conventional_rate_at_lag(
                prof.gen_curve,
                workload.lengths,
                num_devices=workload.devices,
                batch_size=workload.batch_size,
                tau=prof.tau,
                max_lag=int(g),
                max_batch=prof.max_gen_batch,
            )["r"]
            if g <= covered
            else np.nan
            for g in lags
        ]
    )
    return {"max_lag": lags, "pipeline": pipe, "conventional": conv}


def conventional_lag_covered(prof: DeviceProfile, workload: Workload) -> int:
    """Largest lag whose Conventional round (S = B·(lag+1)) the profile covers, or a big number
    when a KV bound caps the per-device batch inside the measured range."""
    cap = prof.gen_curve.max_batch
    if prof.max_gen_batch is not None and prof.max_gen_batch <= cap:
        return 10**9
    # Peak per-device batch of a round is S/N (every sequence is alive at step 1).
    return max(int(math.floor(cap * workload.devices / workload.batch_size)) - 1, -1)


def format_plan(plan: Plan, workload: Workload) -> str:
    """The table the CLI prints."""
    u = plan.unit
    lines = [
        f"devices N={plan.devices}  batch B={workload.batch_size}  lengths: L={workload.lengths.max_len} "
        f"mean={workload.lengths.mean_len:.1f}  lag bound={plan.max_lag}",
        "",
        f"{'':28s}{'PipelineRL':>16s}{'Conventional':>16s}",
        f"{'generation devices':28s}{plan.gen_devices:>16d}{plan.devices:>16d}",
        f"{'training devices':28s}{plan.train_devices:>16d}{plan.devices:>16d}",
        f"{'per-device gen batch H':28s}{plan.gen_batch:>16g}{_conv(plan, 'peak_batch'):>16s}",
        f"{'r_gen (' + u + ')':28s}{plan.r_gen:>16.4g}{_conv(plan, 'r_gen'):>16s}",
        f"{'r_train (' + u + ')':28s}{plan.r_train:>16.4g}{_conv(plan, 'r_train'):>16s}",
        f"{'r predicted (' + u + ')':28s}{plan.r:>16.4g}{_conv(plan, 'r'):>16s}",
        f"{'max lag (optimizer steps)':28s}{plan.lag:>16d}{_conv(plan, 'max_lag'):>16s}",
        # Conventional devices alternate: not generating while training, and vice versa.
        f"{'gen idle fraction':28s}{plan.gen_idle:>16.3f}{_conv(plan, 'train_time_fraction'):>16s}",
        f"{'train idle fraction':28s}{plan.train_idle:>16.3f}{_conv(plan, 'gen_time_fraction'):>16s}",
        f"{'samples per ' + u.split('/')[1]:28s}{plan.samples_rate:>16.4g}",
        f"{'optimizer steps per ' + u.split('/')[1]:28s}{plan.steps_rate:>16.4g}",
    ]
    if workload.hosts is not None:
        lines.append(
            hosts_lib.describe(
                workload.hosts,
                plan.gen_devices,
                plan.devices,
                plan.r,
                workload.batch_size,
                workload.lengths.mean_len,
            )
        )
    if plan.conventional:
        lines.append(
            f"{'speedup over Conventional':28s}{plan.speedup:>16.3f}x  (same lag: "
            f"G={plan.conventional['steps_per_round']} steps per round)"
        )
    return "\n".join(lines)


def _conv(plan: Plan, key: str) -> str:
    c = plan.conventional
    if not c:
        return "-"
    v = c[key]
    if isinstance(v, (int, np.integer)):
        return f"{v:d}"
    return f"{v:.3f}" if key.endswith("fraction") else f"{v:.4g}"
