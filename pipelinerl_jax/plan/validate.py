"""Checking the planner against a real run: the pure half (numpy only, no JAX).

bench/bench_plan_validation.py measures rates, asks the planner, runs the pipeline and lines the
numbers up; the arithmetic it needs lives here so it can be tested by hand:

  RunShape               the settings of a run that the planner sees (N, I, slots, B, lag, L)
  maxent_lengths         a length distribution on 1..L with a run's observed mean
  predict                the planner's numbers (layout.plan_layout) for the run's fixed split
  serial_prediction      the same rates when generation and training cannot overlap at all
  steady_measurement     what a run's metrics.jsonl says about its steady state
  swap_stall_fraction    the part of the sampler's busy time spent waiting for new weights
  comparison_rows        predictions and measurement side by side, one row per quantity

Units: tokens/s and samples/s. The trainer in this project packs a fixed [rows, seq_len] batch
per optimizer step, so its cost is per step, not per generated token; the planner's τ (seconds
per completion token per device) is therefore train_step_s / (B·L̄) for the run's mean length L̄.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pipelinerl_jax.plan import layout, model
from pipelinerl_jax.plan.utilisation import PlanError

QUANTITIES = (
    "samples_per_s",
    "sampler_busy",
    "sampler_idle",
    "trainer_busy",
    "trainer_idle",
    "lag",
)


@dataclasses.dataclass(frozen=True)
class RunShape:
    """A pipeline run as the planner sees it."""

    devices: int  # N; 1 means both roles share one device (the pipeline's shared mode)
    gen_devices: int  # I, devices of the sampler mesh (1 when shared)
    num_slots: int  # sampler slots in total, split evenly over the I devices
    batch_size: int  # B, sequences per optimizer step
    max_lag: int  # the run's lag bound, enforced by admission
    max_new_tokens: int  # L, the longest completion

    def __post_init__(self):
        n, i = self.devices, self.gen_devices
        if n < 1 or not (i == 1 if n == 1 else 1 <= i <= n - 1):
            raise PlanError(
                f"run shape: {i} sampler devices of {n} is not a split the pipeline "
                "makes (1..N-1, or 1 of 1 shared)"
            )
        if self.num_slots < 1 or self.num_slots % i:
            raise PlanError(
                f"run shape: num_slots={self.num_slots} must be a positive multiple "
                f"of the {i} sampler devices"
            )
        if self.batch_size < 1 or self.max_lag < 0 or self.max_new_tokens < 1:
            raise PlanError(
                f"run shape: batch_size={self.batch_size}, max_lag={self.max_lag}, "
                f"max_new_tokens={self.max_new_tokens} must be >= 1, >= 0, >= 1"
            )

    @property
    def shared(self) -> bool:
        return self.devices == 1

    @property
    def train_devices(self) -> int:
        return 1 if self.shared else self.devices - self.gen_devices

    @property
    def gen_batch(self) -> int:
        """H: slots per sampler device (the decode batch each device's chunk is compiled for)."""
        return self.num_slots // self.gen_devices


def maxent_lengths(mean: float, max_len: int) -> model.LengthDistribution:
    """The maximum-entropy distribution on 1..L with the given mean: p(l) ∝ exp(θ·l).

    A run logs only per-step mean lengths; the pipeline formulas need L̄ and L alone (r/L̄ and
    g_max), and this fills in the rest without inventing structure (θ = 0 is uniform)."""
    if max_len < 1 or not 1.0 <= mean <= max_len:
        raise PlanError(f"lengths: mean {mean:g} must lie in [1, max_len={max_len}]")
    ls = np.arange(1, max_len + 1, dtype=np.float64)

    def dist(theta):
        z = theta * (ls - ls.mean())
        p = np.exp(z - z.max())
        return p / p.sum()

    lo, hi = -60.0, 60.0  # dist(±60) puts all but ~e^-60 of the mass on one end
    for _ in range(200):  # the mean is increasing in θ: bisection
        mid = 0.5 * (lo + hi)
        if float(ls @ dist(mid)) < mean:
            lo = mid
        else:
            hi = mid
    p = dist(0.5 * (lo + hi))
    # Keep L in the support: the lag bound g_max needs the longest possible completion.
    p[-1] = max(p[-1], 1e-12)
    return model.LengthDistribution(tuple(p / p.sum()))


def _lag(shape: RunShape, lengths: model.LengthDistribution) -> tuple[int, int]:
    """(g_max of the split, the lag the run can show: admission caps it at max_lag)."""
    g_max = int(
        model.pipeline_max_lag(shape.gen_batch, shape.gen_devices, lengths, shape.batch_size)
    )
    return g_max, min(g_max, shape.max_lag)


def _result(shape, lengths, r, r_gen, r_train, how: str) -> dict:
    g_max, lag = _lag(shape, lengths)
    busy_gen, busy_train = r / r_gen, r / r_train
    return {
        "samples_per_s": r / lengths.mean_len,
        "sampler_busy": busy_gen,
        "sampler_idle": 1.0 - busy_gen,
        "trainer_busy": busy_train,
        "trainer_idle": 1.0 - busy_train,
        "lag": lag,
        "g_max": g_max,
        "r_gen_tokens_per_s": r_gen,
        "r_train_tokens_per_s": r_train,
        "bottleneck": "trainer" if r_train < r_gen else "sampler",
        "model": how,
    }


def serial_prediction(
    shape: RunShape,
    *,
    gen_tokens_per_s: float,
    train_step_s: float,
    lengths: model.LengthDistribution,
) -> dict:
    """Generation and training take turns on the same compute: r = 1/(1/r_gen + 1/r_train).

    gen_tokens_per_s: the whole sampler's rate; train_step_s: the whole trainer's step time.
    This is the paper's Conventional RL time-sharing formula (eq. 12); busy fractions are each
    role's share of the time, r/r_gen and r/r_train, and add to one."""
    if gen_tokens_per_s <= 0 or train_step_s <= 0:
        raise PlanError(
            f"serial prediction: rates must be positive, got {gen_tokens_per_s} "
            f"tokens/s and {train_step_s} s/step"
        )
    r_gen = float(gen_tokens_per_s)
    r_train = shape.batch_size * lengths.mean_len / train_step_s
    return _result(
        shape,
        lengths,
        model.conventional_rate(r_gen, r_train),
        r_gen,
        r_train,
        "serial: 1/(1/r_gen + 1/r_train)",
    )


def predict(
    shape: RunShape,
    *,
    gen_tokens_per_s_per_device: float,
    train_step_s_per_device: float,
    lengths: model.LengthDistribution,
) -> dict:
    """The planner's prediction for the run's own split (I and H fixed, not searched).

    gen_tokens_per_s_per_device: one sampler device decoding at batch H; train_step_s: one
    trainer device doing a whole optimizer step. The planner scales both linearly (U(H)·I and
    (N − I)/τ). A shared single device cannot overlap the roles: the serial formula applies."""
    if gen_tokens_per_s_per_device <= 0 or train_step_s_per_device <= 0:
        raise PlanError(
            f"prediction: rates must be positive, got {gen_tokens_per_s_per_device} "
            f"tokens/s and {train_step_s_per_device} s/step"
        )
    if shape.shared:
        return serial_prediction(
            shape,
            gen_tokens_per_s=gen_tokens_per_s_per_device,
            train_step_s=train_step_s_per_device,
            lengths=lengths,
        )
    h = float(shape.gen_batch)
    prof = layout.DeviceProfile.from_measurements(
        decode_batch_sizes=[h],
        decode_latency_s=[h / gen_tokens_per_s_per_device],
        train_tokens_per_s_per_device=shape.batch_size * lengths.mean_len / train_step_s_per_device,
    )
    g_max, _ = _lag(shape, lengths)
    # plan_layout refuses a split whose g_max exceeds the bound; the run still makes it (its
    # admission throttles), so ask under the looser of the two and report the capped lag.
    work = layout.Workload(shape.devices, shape.batch_size, lengths, max(shape.max_lag, g_max))
    plan = layout.plan_layout(
        prof, work, gen_devices=shape.gen_devices, gen_batch=h, compare_conventional=False
    )
    return _result(
        shape, lengths, plan.r, plan.r_gen, plan.r_train, "planner: min(U(H)·I, (N−I)/τ)"
    )


def _train_records(records: list[dict]) -> tuple[list[dict], dict]:
    train = [r for r in records if r.get("kind") == "train"]
    summaries = [r for r in records if r.get("kind") == "summary"]
    if not summaries:
        raise PlanError("run metrics: no 'summary' record; did the run finish?")
    if len(train) < 4:
        raise PlanError(
            f"run metrics: {len(train)} train records; the steady state needs at "
            "least 4 (raise --steps)"
        )
    return train, summaries[-1]


def steady_measurement(records: list[dict]) -> dict:
    """Steady-state numbers of a run over the second half of its steps (the window the run's
    own summary uses for steady_samples_per_s, so compilation is excluded).

    The per-step busy fractions are cumulative over the time e_k since the threads started.
    A record is stamped ("time") when it is logged, i.e. during the next step, right after that
    step's fractions were computed: e_k ≈ time_{k-1}. The summary gives the exact end point
    (fraction × wall_s). Steady busy = Δ(busy seconds) / Δ(elapsed) between the two.
    """
    train, summary = _train_records(records)
    k = len(train) // 2
    e_mid, e_end = float(train[k - 1]["time"]), float(summary["wall_s"])
    if e_end <= e_mid:
        raise PlanError(
            f"run metrics: summary wall_s={e_end:g} is not after step {k}'s time {e_mid:g}"
        )

    def busy(key):
        return (summary[key] * e_end - train[k][key] * e_mid) / (e_end - e_mid)

    span = float(train[-2]["time"]) - e_mid
    wait = (
        (train[-1]["trainer/wait_s"] - train[k]["trainer/wait_s"]) / span
        if span > 0
        else float("nan")
    )
    window = train[k:]
    sampler_busy, trainer_busy = busy("sampler/busy_frac"), busy("trainer/busy_frac")
    return {
        "samples_per_s": summary["steady_samples_per_s"],
        "steps_per_s": summary["steady_steps_per_s"],
        "sampler_busy": sampler_busy,
        "sampler_idle": 1.0 - sampler_busy,
        "trainer_busy": trainer_busy,
        "trainer_idle": 1.0 - trainer_busy,
        "trainer_wait_frac": wait,
        "lag": int(summary["lag/token_max"]),
        "mean_len": float(np.mean([r["completion/len_mean"] for r in window])),
        "no_eos_frac": float(np.mean([r["completion/no_eos_frac"] for r in window])),
        "window_steps": len(window),
        "wall_s": e_end,
        "first_step_time_s": float(train[0]["time"]),
        "samples_per_s_incl_compile": summary["samples_per_s"],
        "busy_frac_whole_run": {
            "sampler": summary["sampler/busy_frac"],
            "trainer": summary["trainer/busy_frac"],
        },
        "swaps_per_step": summary.get("sampler/swaps", 0) / max(int(summary.get("steps", 0)), 1),
        "swap_latency_s_median": summary.get("sampler/swap_latency_ms_median", 0.0) / 1e3,
    }


def swap_stall_fraction(
    *, steps_per_s: float, swaps_per_step: float, swap_latency_s: float, chunk_s: float
) -> float:
    """Fraction of time the sampler's step() waits for new weights rather than decoding.

    The pipeline publishes params as soon as the train step is dispatched, so the first chunk
    after a swap depends on that step's result and blocks until it is done: the run counts that
    wait as sampler busy time. A swap's latency (publication to the end of the first chunk that
    uses it) beyond one ordinary chunk is that wait; this is the swap rate times it."""
    if min(steps_per_s, swaps_per_step, swap_latency_s, chunk_s) < 0:
        raise PlanError("swap stall: rates and times must be >= 0")
    return min(1.0, steps_per_s * swaps_per_step * max(0.0, swap_latency_s - chunk_s))


def comparison_rows(
    predictions: dict[str, dict], measured: dict, *, label: str = "", reference: str | None = None
) -> list[dict]:
    """One row per quantity: every prediction column, the measurement, measured/reference."""
    if not predictions:
        raise PlanError("comparison: no predictions to compare")
    reference = reference or next(iter(predictions))
    rows = []
    for q in QUANTITIES:
        row = {
            "run": label,
            "quantity": q,
            **{name: p[q] for name, p in predictions.items()},
            "measured": measured[q],
        }
        ref = predictions[reference][q]
        row[f"measured/{reference}"] = (
            measured[q] / ref if ref and math.isfinite(ref) else float("nan")
        )
        rows.append(row)
    return rows
