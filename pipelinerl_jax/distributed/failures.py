"""A failure in one process ends every process of the run, with one line naming it.

Under the supervisor (`--spawn_local`) the supervisor does this. On separate hosts there is
none, and JAX alone only notices a dead peer at the heartbeat timeout, then aborts the others
with a native stack dump that names nobody. So every process of a multi-process run:

- reports its own exception (Ctrl-C included) under one key of the jax.distributed key-value
  store (`report`);
- beats: a daemon thread bumps "pipelinerl/alive/<process id>" every `beat_s`;
- watches (`watch`): the first report from another process, or another process whose beat
  has not moved for `silent_s` (killed outright, or its host gone), is printed as one line on
  stderr and this process exits at once with code 1.

`silent_s` is shorter than JAX's own heartbeat timeout (runtime.initialize), so the named line
comes before JAX's abort. A process that ends normally says so first (`finished`), so its
silence afterwards is not taken for a death.

Elastic runs (`--elastic`): a sampler process's death or failure ends nobody. It does not
report, nobody watches its beat here, and the trainer's RemoteSampler drops it instead
(`Liveness`, remote_sampler.py). A trainer process's still ends every process.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from pipelinerl_jax.distributed import channel
from pipelinerl_jax.distributed.runtime import ProcessSpec

KEY = "pipelinerl/failed"
ALIVE = "pipelinerl/alive/{}"
DONE = "pipelinerl/done/{}"
SEEN = "pipelinerl/seen/{}"  # a process read the failure report and is stopping
# Process 0 hosts the store: once it exits the others abort natively (JAX) before they can
# read the report, so it waits this long at most for every other process to have read it.
LINGER_S = 4.0
STILL_S = 2.5  # a process whose beat has not moved this long while process 0 lingers is dead
BEAT_S = 1.0
SILENT_S = 6.0


def one_line(spec, error: BaseException) -> str:
    """ "process 2 (sampler 1): ValueError: ..." (the first line of the message)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{spec.name}: {type(error).__name__}" + (f": {text}" if text else "")


def report(spec, error: BaseException, client=None) -> None:
    """Records this process's failure for the others (the first report stays)."""
    if spec.elastic and spec.role == "sampler":
        return  # the run goes on without this process (the trainer sees its beat stop)
    client = client or channel.kv_client()
    try:
        client.key_value_set(KEY, one_line(spec, error))
    except Exception:
        pass  # another process reported first (ALREADY_EXISTS), or the store is gone
    _linger(spec, client)


def _linger(spec, client, gone: int | None = None, timeout_s: float = LINGER_S) -> None:
    """Process 0: keeps the store up until every other process has read the report, or is
    dead itself (`gone`, or a beat that does not move while we wait)."""
    if spec.process_id != 0:
        return
    start = time.monotonic()
    others = [p for p in range(1, spec.num_processes) if p != gone]
    try:
        beats = {p: channel.try_get(client, ALIVE.format(p)) for p in others}
        while time.monotonic() - start < timeout_s:
            waiting = []
            for p in others:
                if (
                    channel.try_get(client, SEEN.format(p)) is None
                    and channel.try_get(client, DONE.format(p)) is None
                ):
                    moved = channel.try_get(client, ALIVE.format(p)) != beats[p]
                    if moved or time.monotonic() - start < STILL_S:
                        waiting.append(p)
            if not waiting:
                return
            time.sleep(0.05)
    except Exception:
        return  # the store is gone


def finished(spec, client=None) -> None:
    """This process ends normally: its beat stopping from now on is no failure."""
    try:
        channel.set_value(DONE.format(spec.process_id), True, client)
    except Exception:
        pass  # the store is gone: the run is over anyway


def _peer(spec, process_id: int):

    return ProcessSpec(
        spec.coordinator, spec.num_processes, process_id, spec.trainer_processes, spec.elastic
    )


class _Silence:
    """Which other process has not beaten for `silent_s` (judged only once it has beaten)."""

    def __init__(self, spec, client, silent_s: float):
        self.spec, self.client, self.silent_s = spec, client, silent_s
        self.seen: dict[int, tuple[str, float]] = {}  # process id -> (last beat, when seen)

    def silent(self) -> tuple[int, str] | None:
        """(process id, the line naming it) of a silent process, or None."""
        now = time.monotonic()
        for p in range(self.spec.num_processes):
            if p == self.spec.process_id:
                continue
            if self.spec.elastic and _peer(self.spec, p).role == "sampler":
                continue  # the trainer drops it (Liveness); nobody else minds
            if self.quiet(p, now):
                return p, (
                    f"{_peer(self.spec, p).name} stopped responding (no beat for "
                    f"{self.silent_s:.0f} s: killed, or its host is gone)"
                )
        return None

    def quiet(self, p: int, now: float) -> bool:
        """Whether process `p` has beaten and then not for `silent_s` (and did not finish)."""
        beat = channel.try_get(self.client, ALIVE.format(p))
        if beat is None or channel.try_get(self.client, DONE.format(p)) is not None:
            return False
        last = self.seen.get(p)
        if last is None or last[0] != beat:
            self.seen[p] = (beat, now)
            return False
        return now - last[1] > self.silent_s


def wait_for_samplers(spec, timeout_s: float = 15.0, client=None) -> None:
    """Elastic runs, process 0 at the end: waits until every sampler process has finished or
    is gone (its beat still for STILL_S), up to `timeout_s`."""
    client = client or channel.kv_client()
    silence = _Silence(spec, client, STILL_S)
    samplers = range(spec.trainer_processes, spec.num_processes)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            now = time.monotonic()
            waiting = [
                p
                for p in samplers
                if channel.try_get(client, DONE.format(p)) is None
                and channel.try_get(client, ALIVE.format(p)) is not None
                and not silence.quiet(p, now)
            ]
            if not waiting:
                return
            time.sleep(0.05)
    except Exception:
        return  # the store is gone


class Liveness:
    """Elastic runs, in the trainer process: whether sampler process `index` is gone (its
    beat has not moved for `silent_s`), for RemoteSampler(lost=...). A process restarted with
    the same id beats again under the same key, and counts as alive from then on."""

    def __init__(self, spec, *, silent_s: float = SILENT_S, client=None):
        self._silence = _Silence(spec, client or channel.kv_client(), silent_s)
        self._first = spec.trainer_processes

    def lost(self, index: int) -> bool:
        return self._silence.quiet(self._first + index, time.monotonic())


def watch(
    spec,
    *,
    poll_s: float = BEAT_S,
    silent_s: float = SILENT_S,
    client=None,
    exit=os._exit,
) -> threading.Thread:
    """Starts the daemon threads that beat for this process and end it when another one
    reports a failure or falls silent."""
    client = client or channel.kv_client()
    silence = _Silence(spec, client, silent_s)

    def beat():
        n = 0
        while True:
            try:
                channel.set_value(ALIVE.format(spec.process_id), n, client)
            except Exception:
                return  # the store is gone: the run is ending anyway
            n += 1
            time.sleep(poll_s)

    def run():
        while True:
            gone = None
            try:
                line = channel.wait_get(client, KEY, poll_s)
                if line is None and (found := silence.silent()) is not None:
                    gone, line = found
            except Exception:
                # The store is gone: the run is ending, or process 0, which hosts it, died,
                # and JAX itself ends this process within a second (a native message; under
                # the supervisor the one line names process 0).
                return
            if line is not None and not line.startswith(f"{spec.name}:"):
                print(f"stopping: {line}", file=sys.stderr, flush=True)
                try:
                    channel.set_value(SEEN.format(spec.process_id), True, client)
                    if gone is not None:  # the dead cannot report: say it for them
                        client.key_value_set(KEY, line)
                except Exception:
                    pass  # the store is gone, or another report came first
                _linger(spec, client, gone)
                exit(1)
                return
            if line is not None:
                return  # our own report: the main thread is already on its way out

    threading.Thread(target=beat, name="failure-beat", daemon=True).start()
    thread = threading.Thread(target=run, name="failure-watch", daemon=True)
    thread.start()
    return thread
