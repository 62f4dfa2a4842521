"""A process's place in a multi-process run, and JAX's distributed runtime started with bounds.

One trainer process group and one or more sampler processes share one `jax.distributed`
runtime: process 0 hosts the coordinator service, the first `trainer_processes` processes
train (one mesh over their local devices) and the rest sample (each its own data-parallel
sampler). JAX's defaults suit long-lived jobs, not a run that should end promptly when a peer
dies: a dead process is noticed after `heartbeat_timeout_seconds` (100 s) and startup waits
`initialization_timeout` (300 s) for stragglers. `initialize` shortens both, so a failure ends
the run in tens of seconds.
"""

from __future__ import annotations

import dataclasses
import socket

from pipelinerl_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Where this process is: the coordinator's host:port, how many processes, which one."""

    coordinator: str  # "host:port" of process 0's coordinator service
    num_processes: int
    process_id: int
    trainer_processes: int = 1  # processes 0 .. trainer_processes - 1 train; the rest sample
    elastic: bool = False  # --elastic: a sampler process may die or join; the run goes on

    def __post_init__(self):
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"--coordinator={self.coordinator!r}: expected host:port, e.g. 10.0.0.1:8476"
            )
        if self.num_processes < 2:
            raise ConfigError(
                f"--num_processes={self.num_processes}: a multi-process run needs at least 2 "
                "(one trainer and one sampler); leave the flag out for a single process"
            )
        if not 0 <= self.process_id < self.num_processes:
            raise ConfigError(
                f"--process_id={self.process_id} is outside 0..{self.num_processes - 1} "
                f"(--num_processes={self.num_processes})"
            )
        if not 1 <= self.trainer_processes < self.num_processes:
            raise ConfigError(
                f"trainer_processes={self.trainer_processes}: use 1..{self.num_processes - 1} "
                f"so that at least one of the {self.num_processes} processes samples"
            )

    @property
    def role(self) -> str:
        """ "trainer" or "sampler"."""
        return "trainer" if self.process_id < self.trainer_processes else "sampler"

    @property
    def sampler_index(self) -> int | None:
        """0-based index among the sampler processes (None for a trainer process)."""
        return None if self.role == "trainer" else self.process_id - self.trainer_processes

    @property
    def name(self) -> str:
        """How lines and errors name this process: "process 2 (sampler 1)"."""
        if self.role == "trainer":
            return f"process {self.process_id} (trainer)"
        return f"process {self.process_id} (sampler {self.sampler_index})"


def initialize(
    spec: ProcessSpec,
    *,
    heartbeat_s: int = 20,
    init_timeout_s: int = 60,
    shutdown_timeout_s: int = 10,
) -> None:
    """`jax.distributed.initialize` for this process, with failure detection in seconds."""
    import jax

    if spec.elastic:
        # A task that dies no longer ends the others (JAX's fate-sharing is off), and one
        # started again with the same process id rejoins. Only process 0, which hosts the
        # coordination service, still takes every process with it.
        jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(
        coordinator_address=spec.coordinator,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        initialization_timeout=init_timeout_s,
        heartbeat_timeout_seconds=heartbeat_s,
        shutdown_timeout_seconds=shutdown_timeout_s,
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (for a local coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
