"""Reproducible pipeline mode (config.deterministic): the sampler's schedule fixed by counts.

A pipeline run is non-deterministic only through timing: which decode chunk a new version
lands before, which groups admission lets in at that moment, and in which order rewards come
back. Everything else is a function of the seed already: each attempt samples with its own
seed (sampler._mix32(seed, group index, attempt)), steps train groups in start order, and the
prompt stream is seeded. Deterministic mode takes timing out of the sampler's decisions:

* Swaps. Version v+1 is swapped in `swap_chunks` decode chunks after the chunk at which the
  data of the step that makes it (step v) was complete: about the time the trainer needs for
  that step, so the sampler rarely waits, and it does wait if the trainer is late. A sampler
  with no work left (its lag budget spent) takes v+1 at once. Every version is taken, in
  order (the Publisher keeps the ones not taken yet).
* Rewards are scored in the sampler thread as each group finishes, so a group's drop
  (dynamic sampling) and the admission slot it frees land at a fixed chunk boundary.
* Checkpoints are taken at drained points: before checkpoint step S, admission stops once
  S steps' worth of kept groups have started, the sampler finishes what is in flight, takes
  version S and waits until the checkpoint of step S is saved. A resumed run then starts from
  exactly the state the uninterrupted run is in (version S, nothing in flight, no chunk since
  the swap), so it replays it bit for bit. That costs one bubble per checkpoint.

Why the waits never deadlock: the sampler waits for v+1 only when step v's groups are all
scored (due swap), or when nothing is in flight and admission is shut; then every started
group is scored and, since admission had let at least (v+1) steps' worth of kept groups
start, step v's data is complete (admission.py).
"""

from __future__ import annotations

import math
import os
import zlib

import numpy as np

# XLA's deterministic scatter and reductions on GPUs (XLA:CPU needs no flag: it runs a compiled
# program the same way every time on one machine and thread count).
GPU_XLA_FLAG = "--xla_gpu_deterministic_ops=true"


def set_xla_flags(environ=os.environ) -> None:
    """Adds GPU_XLA_FLAG to XLA_FLAGS (before JAX starts its backends: launch.py calls it)."""
    flags = environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in flags:
        environ["XLA_FLAGS"] = f"{flags} {GPU_XLA_FLAG}".strip()


def derived_swap_chunks(cfg) -> int:
    """Chunks from a step's complete data to its version's swap when config.swap_chunks is 0:
    the decode chunks the sampler runs in about the time the trainer takes for a step, taken
    as the ratio of a step's trained tokens (forward and backward: 3 passes) to a chunk's
    decoded tokens with every slot busy, a decoded token costing as much as 8 trained ones
    (decode reads all weights for a few rows)."""
    trained = 3 * cfg.batch_size * (cfg.max_prompt_tokens + cfg.max_new_tokens)
    decoded = 8 * cfg.sampler.num_slots * cfg.sampler.chunk_steps
    return max(1, math.ceil(trained / decoded))


class SwapSchedule:
    """The sampler thread's deterministic decisions: when to swap, how far admission may go
    before a checkpoint, and which steps' data is complete. Used by that thread alone."""

    def __init__(
        self,
        *,
        swap_chunks: int,
        groups_per_step: int,
        drain_every: int,
        steps: int,
        start_step: int,
        next_index: int,
    ):
        self.swap_chunks = swap_chunks
        self.groups_per_step = groups_per_step
        self.drain_every = drain_every  # checkpoint_every when checkpoints are saved, else 0
        self.steps = steps
        self.passed = start_step  # the newest checkpoint step whose drain is behind us
        self.chunk = 0  # decode chunks run since the start or the last drain
        self._next = next_index  # the first group not yet scored (in start order)
        self._kept = start_step * groups_per_step  # kept groups before _next
        self._ahead: dict[int, bool] = {}  # scored groups past _next: index -> kept
        self._ready_at: dict[int, int] = {}  # step -> the chunk its data was complete after

    def scored(self, index: int, kept: bool) -> None:
        """Group `index` is scored (or restored scored, or dropped)."""
        self._ahead[index] = kept
        g = self.groups_per_step
        while self._next in self._ahead:
            if self._ahead.pop(self._next):
                self._kept += 1
                if self._kept % g == 0:
                    self._ready_at[self._kept // g - 1] = self.chunk
            self._next += 1

    def step_ready(self, step: int) -> bool:
        """Whether every group step `step` trains is scored."""
        return self._kept >= (step + 1) * self.groups_per_step

    def ran_chunk(self) -> None:
        self.chunk += 1

    def swap_due(self, version: int) -> bool:
        """Whether version+1 goes in now: its step's data has been complete for swap_chunks."""
        ready = self._ready_at.get(version)
        return ready is not None and self.chunk >= ready + self.swap_chunks

    def barrier(self) -> int | None:
        """The next checkpoint step the sampler must drain at (None: no more checkpoints
        before the end, which is saved after the threads stopped)."""
        if not self.drain_every:
            return None
        step = (self.passed // self.drain_every + 1) * self.drain_every
        return step if step < self.steps else None

    def admission_limit(self) -> int | None:
        """Kept groups (started - dropped) admission may reach before the next drain."""
        step = self.barrier()
        return None if step is None else step * self.groups_per_step

    def drained(self, step: int) -> None:
        """The checkpoint of `step` is saved with nothing in flight; admission opens again and
        chunks count from 0, as they do in a run resumed from that checkpoint."""
        self.passed = step
        self.chunk = 0
        self._ready_at = {s: 0 for s in self._ready_at if s >= step}


def batch_crc(batch) -> int:
    """crc32 of what a step trains (tokens, behaviour logprobs, versions, advantages): equal
    in two runs exactly when they trained the same batch, bit for bit."""
    crc = 0
    for name in ("tokens", "behaviour_logprobs", "versions", "advantages", "loss_mask"):
        crc = zlib.crc32(np.ascontiguousarray(np.asarray(getattr(batch, name))).tobytes(), crc)
    return crc


class Deterministic:
    """Drives a Coordinator's sampler thread by a SwapSchedule (built when the run starts,
    after a resume has restored the coordinator)."""

    def __init__(self, coord, *, swap_chunks: int, drain_every: int):
        self.coord = coord
        self.schedule = SwapSchedule(
            swap_chunks=swap_chunks,
            groups_per_step=coord.admission.groups_per_step,
            drain_every=drain_every,
            steps=coord.cfg.steps,
            start_step=coord.step,
            next_index=coord.next_index,
        )
        for group in coord.pending.values():  # restored scored, from the checkpoint
            if group.rewards:
                self.schedule.scored(group.index, True)
        for index in coord.board.dropped_indices():
            self.schedule.scored(index, False)

    def before_chunk(self) -> bool:
        """At a chunk boundary: the swap that is due, then the drain of a checkpoint step
        reached (waiting for its save). False once the run is stopping."""
        coord, schedule = self.coord, self.schedule
        version = coord._sampler_version()
        if schedule.swap_due(version):
            if not self.take(version + 1):
                return False
            version += 1
        barrier = schedule.barrier()
        if barrier is not None and version == barrier:
            # Nothing is in flight: admission stopped at `barrier` steps of kept groups, and
            # step barrier - 1 could only end once all of them were scored.
            if not self._wait(lambda: coord.steps_ended >= barrier):
                return False
            schedule.drained(barrier)
        return True

    def take(self, version: int) -> bool:
        """Swaps in exactly `version`, waiting for the trainer to publish it."""
        coord = self.coord
        staged = None

        def published():
            nonlocal staged
            staged = coord.publisher.take_version(version)
            return staged is not None

        if not self._wait(published):
            return False
        coord.swap_in(staged)
        return True

    def _wait(self, ready, poll_s: float = 0.001) -> bool:
        stop = self.coord.stop
        while not ready():
            if stop.wait(poll_s):
                return False
        return True
