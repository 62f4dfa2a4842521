"""Lag control: which groups may start, and which groups each training step trains.

Lag of a token = the trainer's version when the token is trained − the version that produced
it. A group started while the sampler held version v only contains tokens of versions >= v,
so its worst lag is (the step that trains it) − v. Two rules bound it by `max_lag` exactly:

* Training order = start order: step s trains the groups with start indices
    [s·g, (s+1)·g), g = groups per step, waiting for any of them still generating.
* Admission: at sampler version v a group may start only while the number of groups ever
    started stays below (v + max_lag + 1)·g. Group n started at version v therefore has
    n < (v + max_lag + 1)·g, is trained at step floor(n/g) <= v + max_lag, and its lag is at
    most max_lag.

Dropped groups (dynamic sampling, filtering.py) give their slot back: admission counts
started − dropped groups against the budget, and a step trains the next g *kept* groups in
start order. The bound still holds: kept group n, started at version v after d groups were
dropped, has n − d < (v + max_lag + 1)·g; at least d of the groups before it are dropped (any
dropped later only lowers its position), so its position among kept groups is at most n − d
and it is trained at step <= v + max_lag.

Training in start order is also what keeps batches unbiased: training whatever finishes first
favours short answers (a known failure of drop-the-oldest buffers, see docs/paper_facts.md).

Conventional RL uses the same machinery with rounds of R steps: a round's R·g groups start
with one frozen version (R·k), the publisher only hands the sampler round versions, and the
next round can start only once its weights arrived. Lag is at most R − 1 and every token of a
round carries one version.
"""

import threading

from pipelinerl_jax.errors import ConfigError


class Admission:
    """Thread-safe admission counter shared by the sampler thread and the trainer thread."""

    def __init__(
        self, *, groups_per_step: int, max_lag: int, mode: str = "pipeline", round_steps: int = 1
    ):
        if groups_per_step < 1:
            raise ConfigError(f"groups_per_step={groups_per_step} must be >= 1")
        if mode not in ("pipeline", "conventional"):
            raise ConfigError(f"unknown mode {mode!r}: use 'pipeline' or 'conventional'")
        if mode == "pipeline" and max_lag < 0:
            raise ConfigError(f"max_lag={max_lag} must be >= 0 (0 means fully on-policy)")
        if mode == "conventional" and round_steps < 1:
            raise ConfigError(f"round_steps={round_steps} must be >= 1 in conventional mode")
        self.groups_per_step = groups_per_step
        self.max_lag = max_lag
        self.mode = mode
        self.round_steps = round_steps
        self._started = 0
        self._dropped = 0
        self._lock = threading.Lock()

    @property
    def started(self) -> int:
        with self._lock:
            return self._started

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped

    def restore(self, started: int, dropped: int = 0) -> None:
        """Sets the started- and dropped-groups counters (resume: groups are renumbered from
        there)."""
        with self._lock:
            self._started, self._dropped = started, dropped

    def drop(self) -> None:
        """A started group was dropped (filtering.py): its slot may start another group."""
        with self._lock:
            self._dropped += 1

    def capacity(self, sampler_version: int) -> int:
        """Total groups that may have started while the sampler holds `sampler_version`."""
        if self.mode == "pipeline":
            return (sampler_version + self.max_lag + 1) * self.groups_per_step
        round_start = (sampler_version // self.round_steps) * self.round_steps
        return (round_start + self.round_steps) * self.groups_per_step

    def available(self, sampler_version: int) -> int:
        """How many more groups may start now."""
        with self._lock:
            return max(0, self.capacity(sampler_version) - self._started + self._dropped)

    def try_start(self, sampler_version: int, limit: int | None = None) -> int | None:
        """Admits one group; returns its start index, or None when the lag budget is spent
        (or started - dropped groups have reached `limit`: a deterministic run's drain)."""
        with self._lock:
            cap = self.capacity(sampler_version)
            if limit is not None:
                cap = min(cap, limit)
            if self._started - self._dropped >= cap:
                return None
            index = self._started
            self._started += 1
            return index

    def step_indices(self, step: int) -> range:
        """Start indices of the groups that optimizer step `step` trains when none is dropped
        (with drops, the next kept ones: ReadyBoard.take_kept)."""
        return range(step * self.groups_per_step, (step + 1) * self.groups_per_step)

    def lag_bound(self) -> int:
        """The largest lag this policy allows (the paper's g_max for the run's settings)."""
        return self.max_lag if self.mode == "pipeline" else self.round_steps - 1

    def publishes(self, version: int) -> bool:
        """Whether weights of `version` go to the sampler (conventional: round starts only)."""
        return self.mode == "pipeline" or version % self.round_steps == 0
