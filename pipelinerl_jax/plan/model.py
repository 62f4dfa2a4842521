"""The paper's throughput model (PipelineRL, arXiv 2509.19128, Appendix A) as pure functions.

Notation (the paper's, kept so each function can be checked against it):
  N  accelerators                 B  sequences per optimizer step (training batch)
  G  optimizer steps per Conventional RL generation round; S = B·G sequences per round
  L  maximum sequence length      L̄  mean sequence length; K = S·L̄ tokens per round
  h(l) sequences still decoding at step l (l = 1..L)
  U(h) per-device utilisation at per-device batch h (a `UtilisationCurve`)
  τ  amortised training time per token (the paper's ε)
  H  per-device batch of a PipelineRL generation device;  I  generation devices

Units: in the paper time is measured in flashes, f = F_gen / M (one token's forward FLOPs over
the device's peak FLOP/s), so U(h) is tokens per flash per device and τ is flashes per token.
Every function here is unit-agnostic: feed a curve in tokens/s and τ in seconds/token (the
talk's measured form, see layout.py) and the rates come out in tokens/s.

Conventional RL (eqs. 12-14):  r_conv = 1 / (1/r_gen + 1/r_train),  r_train = N/τ,
  r_gen = K / Σ_l (h(l)/N) / U(h(l)/N)            max lag = G − 1 optimizer steps.
PipelineRL (eqs. 15-17):  r_pipe = min(U(H)·I, (N − I)/τ),  g_max = ceil(H·I·L / (L̄·B)).
Same-lag comparison (A.3): for each lag bound, search all (H, I) for the best r_pipe.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from pipelinerl_jax.plan.utilisation import PlanError, UtilisationCurve


def flash_seconds(flops_per_token: float, peak_flops: float) -> float:
    """One flash in seconds, f = F_gen / M: the least time one generated token can cost."""
    if flops_per_token <= 0 or peak_flops <= 0:
        raise PlanError(
            f"flash needs positive FLOPs per token and peak FLOP/s, got "
            f"{flops_per_token} and {peak_flops}"
        )
    return flops_per_token / peak_flops


def forward_flops_per_token(matmul_params_per_token: int) -> float:
    """F_gen ignoring attention FLOPs, as the paper does: 2 FLOPs per matmul weight."""
    return 2.0 * matmul_params_per_token


# -- sequence lengths -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Distribution of generated sequence lengths on 1..L (probabilities sum to one)."""

    probs: tuple[float, ...]  # probs[i] = P(length = i + 1)

    def __post_init__(self):
        p = np.asarray(self.probs, dtype=np.float64)
        if p.ndim != 1 or p.size == 0 or np.any(p < 0) or not np.isclose(p.sum(), 1.0):
            raise PlanError("sequence lengths: need a non-empty probability vector over 1..L")
        last = int(np.flatnonzero(p)[-1])  # L is the longest length that occurs
        object.__setattr__(self, "probs", tuple(float(x) for x in p[: last + 1]))

    @classmethod
    def uniform(cls, max_len: int) -> LengthDistribution:
        """Uniform on 1..L, the paper's case-study assumption."""
        if max_len < 1:
            raise PlanError(f"--max_len={max_len}: must be at least 1")
        return cls(tuple(np.full(max_len, 1.0 / max_len)))

    @classmethod
    def from_lengths(cls, lengths: Sequence[int]) -> LengthDistribution:
        """Empirical distribution of observed lengths (e.g. from a run's metrics)."""
        arr = np.asarray(lengths, dtype=np.int64).ravel()
        if arr.size == 0 or arr.min() < 1:
            raise PlanError("sequence lengths: need at least one length, all >= 1")
        counts = np.bincount(arr - 1)
        return cls(tuple(counts / counts.sum()))

    @classmethod
    def from_histogram(cls, hist: Mapping[int, float]) -> LengthDistribution:
        """From {length: count}; counts may be any non-negative weights."""
        if not hist:
            raise PlanError("sequence length histogram is empty")
        keys = [int(k) for k in hist]
        if min(keys) < 1 or any(float(v) < 0 for v in hist.values()):
            raise PlanError("sequence length histogram: lengths must be >= 1, counts >= 0")
        counts = np.zeros(max(keys))
        for k, v in hist.items():
            counts[int(k) - 1] += float(v)
        if counts.sum() <= 0:
            raise PlanError("sequence length histogram has zero total count")
        return cls(tuple(counts / counts.sum()))

    @property
    def max_len(self) -> int:
        return len(self.probs)

    @property
    def mean_len(self) -> float:
        return float(np.dot(np.arange(1, self.max_len + 1), self.probs))

    def survival(self) -> np.ndarray:
        """P(length >= l) for l = 1..L: the fraction of a round still decoding at step l."""
        p = np.asarray(self.probs)
        return np.cumsum(p[::-1])[::-1]


def active_sequences(dist: LengthDistribution, num_sequences: float) -> np.ndarray:
    """h(l) for l = 1..L: sequences of a round of S that are still decoding at step l.

    Σ_l h(l) = S·L̄ = K, the round's token count, since each sequence is counted once per token.
    """
    return num_sequences * dist.survival()


# -- Conventional RL -------------------------------------------------------------------------


def conventional_gen_time(
    curve: UtilisationCurve,
    dist: LengthDistribution,
    num_devices: int,
    num_sequences: float,
    *,
    max_batch: float | None = None,
) -> float:
    """t_gen (eq. 10): Σ_l step_time(h(l)/N), all N devices decoding one round of S sequences.

    max_batch: per-device memory bound (KV cache). Above it a device cannot hold its share at
    once; it then runs at its bound's rate throughout (continuous batching keeps it full), so a
    step of x > max_batch sequences costs x / rate(max_batch).
    """
    x = active_sequences(dist, num_sequences) / num_devices
    what = f"Conventional RL with S={num_sequences:g} sequences on {num_devices} devices"
    if max_batch is not None and np.max(x) > max_batch:
        capped = np.minimum(x, max_batch)
        t = curve.step_time(capped, what=what)
        full_rate = float(curve.rate(max_batch, what=what))
        t = np.where(x > max_batch, x / full_rate, t)
    else:
        t = curve.step_time(x, what=what)
    return float(np.sum(t))


def conventional_gen_rate(
    curve: UtilisationCurve,
    dist: LengthDistribution,
    num_devices: int,
    num_sequences: float,
    *,
    max_batch: float | None = None,
) -> float:
    """r_gen_conv (eq. 13) = K / Σ_l (h(l)/N) / U(h(l)/N)."""
    tokens = num_sequences * dist.mean_len
    return tokens / conventional_gen_time(
        curve, dist, num_devices, num_sequences, max_batch=max_batch
    )


def train_rate(num_train_devices: int, tau: float) -> float:
    """Training throughput of n devices: n / τ (eq. 14 with n = N, eq. 17 with n = N − I)."""
    if tau <= 0:
        raise PlanError(f"tau={tau}: training time per token must be positive")
    return num_train_devices / tau


def conventional_rate(r_gen: float, r_train: float) -> float:
    """r_conv (eq. 12): generation and training alternate, so their times add."""
    return 1.0 / (1.0 / r_gen + 1.0 / r_train)


def conventional_max_lag(steps_per_round: int) -> int:
    """A round of G optimizer steps trains its last batch G − 1 steps after generation."""
    return steps_per_round - 1


# -- PipelineRL -------------------------------------------------------------------------------


def pipeline_gen_rate(curve: UtilisationCurve, gen_batch, gen_devices) -> np.ndarray:
    """r_gen_pipe (eq. 16) = U(H)·I."""
    return curve.rate(gen_batch, what="PipelineRL generation") * np.asarray(gen_devices)


def pipeline_rate(r_gen, r_train) -> np.ndarray:
    """r_pipe (eq. 15): the slower stage sets the pace."""
    return np.minimum(r_gen, r_train)


def pipeline_max_lag(gen_batch, gen_devices, dist: LengthDistribution, batch_size: int):
    """g_max = ceil(H·I·L / (L̄·B)).

    While the longest sequence (L steps) decodes, the generation devices emit H·I·L tokens,
    i.e. H·I·L/L̄ sequences, i.e. that many / B optimizer steps happen after it started.
    """
    x = (
        np.asarray(gen_batch, dtype=np.float64)
        * np.asarray(gen_devices)
        * dist.max_len
        / (dist.mean_len * batch_size)
    )
    return np.ceil(x - 1e-9).astype(np.int64)  # tolerance: H·I·L/(L̄·B) is often an integer


# -- same-lag search ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PipelineGrid:
    """r_pipe and g_max for every (H, I) considered; arrays are [len(gen_batches), N − 1]."""

    gen_batches: np.ndarray  # H values, [nH]
    gen_devices: np.ndarray  # I values 1..N−1, [nI]
    r_gen_HxI: np.ndarray
    r_train_HxI: np.ndarray
    r_pipe_HxI: np.ndarray
    lag_HxI: np.ndarray

    def keep_gen_devices(self, keep_I: np.ndarray) -> PipelineGrid:
        """The grid over the I values where the boolean mask `keep_I` [nI] is set."""
        return dataclasses.replace(
            self,
            gen_devices=self.gen_devices[keep_I],
            r_gen_HxI=self.r_gen_HxI[:, keep_I],
            r_train_HxI=self.r_train_HxI[:, keep_I],
            r_pipe_HxI=self.r_pipe_HxI[:, keep_I],
            lag_HxI=self.lag_HxI[:, keep_I],
        )


def pipeline_grid(
    curve: UtilisationCurve,
    dist: LengthDistribution,
    *,
    num_devices: int,
    batch_size: int,
    tau: float,
    max_gen_batch: float | None = None,
    gen_batches: Sequence[float] | None = None,
) -> PipelineGrid:
    """Evaluates every split I in 1..N−1 and per-device batch H (integers up to the bound)."""
    if num_devices < 2:
        raise PlanError(
            f"--devices={num_devices}: a PipelineRL split needs at least 2 devices "
            "(one generating, one training)"
        )
    if batch_size < 1:
        raise PlanError(f"--batch={batch_size}: must be at least 1 sequence per optimizer step")
    bound = curve.max_batch if max_gen_batch is None else min(curve.max_batch, max_gen_batch)
    if gen_batches is None:
        if bound < 1:
            raise PlanError(
                f"per-device generation batch bound {bound:g} is below 1 sequence; "
                "a device needs memory for at least one sequence"
            )
        gen_batches = np.arange(1, int(math.floor(bound)) + 1, dtype=np.float64)
    h = np.asarray(gen_batches, dtype=np.float64)
    i = np.arange(1, num_devices, dtype=np.float64)
    r_gen = np.outer(curve.rate(h, what="PipelineRL generation"), i)
    r_train = np.broadcast_to(train_rate(1, tau) * (num_devices - i), r_gen.shape)
    lag = pipeline_max_lag(h[:, None], i[None, :], dist, batch_size)
    return PipelineGrid(
        h, i.astype(np.int64), r_gen, np.array(r_train), pipeline_rate(r_gen, r_train), lag
    )


@dataclasses.dataclass(frozen=True)
class PipelineChoice:
    gen_batch: float  # H
    gen_devices: int  # I
    r_gen: float
    r_train: float
    r_pipe: float
    max_lag: int  # g_max of this choice


def min_feasible_lag(grid: PipelineGrid) -> int:
    return int(grid.lag_HxI.min())


def best_pipeline(grid: PipelineGrid, max_lag: int) -> PipelineChoice:
    """argmax r_pipe over (H, I) with g_max <= max_lag; ties -> smaller lag, then smaller H·I."""
    ok = grid.lag_HxI <= max_lag
    if not ok.any():
        lo = min_feasible_lag(grid)
        raise PlanError(
            f"--max_lag={max_lag}: no (H, I) split keeps g_max that low; the smallest "
            f"max_lag any split reaches is {lo} (raise --max_lag to >= {lo}, or raise "
            "--batch)"
        )
    r = np.where(ok, grid.r_pipe_HxI, -np.inf)
    best = r.max()
    # Relative tolerance so ties from float noise resolve by the secondary keys.
    near = np.flatnonzero(ok & (grid.r_pipe_HxI >= best * (1 - 1e-12)))
    load = (grid.gen_batches[:, None] * grid.gen_devices[None, :]).ravel()
    pick = near[np.lexsort((load[near], grid.lag_HxI.ravel()[near]))[0]]
    a, b = np.unravel_index(int(pick), grid.lag_HxI.shape)
    return PipelineChoice(
        float(grid.gen_batches[a]),
        int(grid.gen_devices[b]),
        float(grid.r_gen_HxI[a, b]),
        float(grid.r_train_HxI[a, b]),
        float(grid.r_pipe_HxI[a, b]),
        int(grid.lag_HxI[a, b]),
    )


def best_rate_by_lag(grid: PipelineGrid, max_lags: Sequence[int]) -> np.ndarray:
    """Best r_pipe for each lag bound (NaN where no split qualifies): one sort, one cummax."""
    lags = grid.lag_HxI.ravel()
    rates = grid.r_pipe_HxI.ravel()
    order = np.argsort(lags, kind="stable")
    sorted_lags = lags[order]
    running = np.maximum.accumulate(rates[order])
    idx = np.searchsorted(sorted_lags, np.asarray(max_lags), side="right") - 1
    return np.where(idx >= 0, running[np.maximum(idx, 0)], np.nan)


def conventional_rate_at_lag(
    curve: UtilisationCurve,
    dist: LengthDistribution,
    *,
    num_devices: int,
    batch_size: int,
    tau: float,
    max_lag: int,
    max_batch: float | None = None,
) -> dict[str, float]:
    """Conventional RL with G = max_lag + 1 steps per round (its lag is exactly G − 1)."""
    steps = max_lag + 1
    r_gen = conventional_gen_rate(curve, dist, num_devices, batch_size * steps, max_batch=max_batch)
    r_train = train_rate(num_devices, tau)
    return {
        "steps_per_round": steps,
        "peak_batch": batch_size * steps / num_devices,
        "r_gen": r_gen,
        "r_train": r_train,
        "r": conventional_rate(r_gen, r_train),
        "max_lag": conventional_max_lag(steps),
    }
