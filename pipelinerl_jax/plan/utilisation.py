"""Per-device generation speed as a function of batch size: the paper's U(h), as data.

One class serves both unit systems of the planner:

- paper units (Appendix A): `values` are the utilisation U(h) = achieved / peak FLOP/s, which is
  also a device's generation rate in tokens per flash at per-device batch h;
- the talk's units: built from measured decode latencies, `values` are tokens/s per device,
  h / latency(h).

Either way the curve answers two questions: `rate(h)` (tokens per time unit per device) and
`step_time(h)` (time of one decode step that advances h sequences by one token, h / rate(h)).

Interpolation happens on the step time, linearly between measured batch sizes, because decode
latency is close to affine in the batch (weight reads plus per-sequence work), so linear
interpolation is exact for that model where interpolating U linearly is not. Below the smallest
measured batch the step time is held constant: a step cannot get cheaper than reading the weights,
which is the paper's remark that x/U(x) is nearly constant for small x. Above the largest measured
batch the curve refuses to guess (`ProfileCoverageError`): a planner that extrapolated would
recommend batch sizes nobody measured.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from pipelinerl_jax.errors import ConfigError

UNIT_FRACTION = "fraction_of_peak"  # U(h); rate in tokens/flash, step time in flashes
UNIT_TOKENS_PER_S = "tokens_per_s"  # measured decode; rate in tokens/s, step time in seconds
UNITS = (UNIT_FRACTION, UNIT_TOKENS_PER_S)


class PlanError(ConfigError):
    """Impossible or malformed planning request; the message says what would satisfy it."""


class ProfileCoverageError(PlanError):
    """The plan needs a batch size beyond the largest one the profile measured."""


@dataclasses.dataclass(frozen=True)
class UtilisationCurve:
    """Per-device generation rate at measured batch sizes (see module docstring for units)."""

    batch_sizes: tuple[float, ...]  # strictly increasing, > 0
    values: tuple[float, ...]  # rate at each batch size (> 0)
    unit: str = UNIT_FRACTION
    source: str = ""  # free text: how it was measured or derived

    def __post_init__(self):
        h = np.asarray(self.batch_sizes, dtype=np.float64)
        v = np.asarray(self.values, dtype=np.float64)
        name = self.source or "utilisation curve"
        if h.ndim != 1 or h.size == 0 or h.shape != v.shape:
            raise PlanError(
                f"{name}: batch_sizes ({h.size}) and values ({v.size}) must be equal-length, "
                "non-empty lists"
            )
        if np.any(h <= 0) or np.any(np.diff(h) <= 0):
            raise PlanError(
                f"{name}: batch_sizes must be positive and strictly increasing, got "
                f"{list(self.batch_sizes)}"
            )
        if not np.all(np.isfinite(v)) or np.any(v <= 0):
            raise PlanError(
                f"{name}: every value must be a positive finite rate, got {list(self.values)}"
            )
        if self.unit not in UNITS:
            raise PlanError(f"{name}: unit {self.unit!r} is not one of {UNITS}")
        object.__setattr__(self, "batch_sizes", tuple(float(x) for x in h))
        object.__setattr__(self, "values", tuple(float(x) for x in v))

    @property
    def max_batch(self) -> float:
        return self.batch_sizes[-1]

    def _check_covered(self, h: np.ndarray, what: str) -> None:
        if h.size and float(np.max(h)) > self.max_batch * (1 + 1e-9):  # float noise in h(l)
            raise ProfileCoverageError(
                f"{what} needs per-device batch {float(np.max(h)):g} but the profile "
                f"({self.source or 'curve'}) measures only up to {self.max_batch:g}; re-measure "
                f"up to batch {int(np.ceil(np.max(h) - 1e-9))} (plan measure --batch_sizes or "
                "--decode_batch_sizes) or ask for a smaller batch/lag"
            )

    def step_time(self, h, *, what: str = "the plan") -> np.ndarray:
        """Time of one decode step at per-device batch h (flashes or seconds), interpolated."""
        h = np.asarray(h, dtype=np.float64)
        self._check_covered(h, what)
        xs = np.asarray(self.batch_sizes)
        ts = xs / np.asarray(self.values)
        return np.interp(h, xs, ts)  # clamps to ts[0] below the first point: see docstring

    def rate(self, h, *, what: str = "the plan") -> np.ndarray:
        """Generation rate per device at batch h (tokens/flash = U(h), or tokens/s)."""
        h = np.asarray(h, dtype=np.float64)
        return h / self.step_time(h, what=what)

    __call__ = rate

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_sizes": list(self.batch_sizes),
            "values": list(self.values),
            "unit": self.unit,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, name: str = "profile") -> UtilisationCurve:
        try:
            return cls(
                tuple(d["batch_sizes"]),
                tuple(d["values"]),
                unit=d.get("unit", UNIT_FRACTION),
                source=d.get("source", name),
            )
        except (KeyError, TypeError) as e:
            raise PlanError(
                f"{name}: a curve needs 'batch_sizes' and 'values' lists ({e})"
            ) from None

    @classmethod
    def from_decode_latency(cls, batch_sizes, latency_s, *, source: str = "") -> UtilisationCurve:
        """Tokens/s per device from measured seconds per decode step at each batch size."""
        h = np.asarray(batch_sizes, dtype=np.float64)
        lat = np.asarray(latency_s, dtype=np.float64)
        if h.shape != lat.shape or np.any(lat <= 0):
            raise PlanError(
                f"{source or 'decode profile'}: need one positive latency per batch "
                f"size, got {list(latency_s)} for {list(batch_sizes)}"
            )
        return cls(tuple(h), tuple(h / lat), unit=UNIT_TOKENS_PER_S, source=source)

    def truncated(self, max_batch: float) -> UtilisationCurve:
        """The curve restricted to batch sizes <= max_batch (e.g. a KV-cache memory bound)."""
        keep = [i for i, h in enumerate(self.batch_sizes) if h <= max_batch]
        if not keep:
            raise PlanError(
                f"{self.source or 'curve'}: no measured batch size fits the bound "
                f"{max_batch:g} (smallest measured is {self.batch_sizes[0]:g}); "
                "raise the memory bound or measure smaller batches"
            )
        return dataclasses.replace(
            self,
            batch_sizes=tuple(self.batch_sizes[i] for i in keep),
            values=tuple(self.values[i] for i in keep),
        )


def roofline_curve(
    batch_sizes,
    *,
    peak_flops: float,
    bandwidth: float,
    m: int = 4096,
    n: int = 16384,
    bytes_per_element: int = 2,
    efficiency: float = 1.0,
    source: str = "",
) -> UtilisationCurve:
    """U(h) of the (m,h)·(h,n) matmul under the roofline model, times `efficiency`.

    FLOPs 2·m·h·n; bytes (m·h + h·n + m·n)·bytes_per_element; U = min(1, intensity·bw/peak).
    Derived from two published numbers per device, not measured: use it only where no profile
    exists (the paper's U(h) table was never published).
    """
    h = np.asarray(batch_sizes, dtype=np.float64)
    flops = 2.0 * m * h * n
    bytes_moved = (m * h + h * n + m * n) * bytes_per_element
    u = efficiency * np.minimum(1.0, flops / bytes_moved * bandwidth / peak_flops)
    return UtilisationCurve(
        tuple(h), tuple(u), unit=UNIT_FRACTION, source=source or "roofline model"
    )


# -- profile files --------------------------------------------------------------------------

PROFILE_FORMAT = "pipelinerl_jax.plan.profile/1"


def save_profile(profile: dict[str, Any], path: str | Path) -> Path:
    """Writes a profile JSON atomically (temporary name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": PROFILE_FORMAT, **profile}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def load_profile(path: str | Path) -> dict[str, Any]:
    """Reads and checks a profile JSON (see measure.py for the fields it holds)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(
            f"--profile={path}: no such file; create one with "
            "`python -m pipelinerl_jax.plan measure --out=...`"
        ) from None
    except json.JSONDecodeError as e:
        raise PlanError(f"--profile={path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise PlanError(
            f"--profile={path}: not a planner profile (expected format "
            f"{PROFILE_FORMAT!r}); create one with `python -m pipelinerl_jax.plan measure`"
        )
    if "utilisation" not in data and "decode" not in data:
        raise PlanError(f"--profile={path}: holds neither a 'utilisation' nor a 'decode' section")
    return data


def utilisation_from_profile(profile: dict[str, Any], *, name: str = "profile") -> UtilisationCurve:
    if "utilisation" not in profile:
        raise PlanError(
            f"{name}: has no 'utilisation' section; run `plan measure` with the matmul "
            "recipe enabled"
        )
    return UtilisationCurve.from_dict(profile["utilisation"], name=f"{name} utilisation")


def decode_curve_from_profile(
    profile: dict[str, Any], *, name: str = "profile"
) -> UtilisationCurve:
    dec = profile.get("decode")
    if not dec:
        raise PlanError(f"{name}: has no 'decode' section (decode latency per batch size)")
    try:
        return UtilisationCurve.from_decode_latency(
            dec["batch_sizes"], dec["latency_s"], source=f"{name} decode"
        )
    except KeyError as e:
        raise PlanError(f"{name}: 'decode' needs 'batch_sizes' and 'latency_s' ({e})") from None
