"""A process pool for reward functions with a hard per-sample timeout.

Why not concurrent.futures: a task cannot be killed there, and one dead worker breaks the
whole pool. Here every worker is a process with its own pipe; a manager thread hands one task
at a time to each idle worker and watches the deadlines. A task past its deadline gets its
worker SIGKILLed and replaced, and resolves as `Verdict(status="timeout")`; a worker that dies
(segfault, os._exit, out of memory) resolves its task as `error` and is replaced; a reward
function that raises resolves as `error`. The run never hangs on, nor dies of, a completion.

Workers start with the `forkserver` method by default: forking the (multithreaded) JAX
process is unsafe, and the fork server preloads the reward module (sympy for math-verify) so
a replacement worker is ready in milliseconds. Workers ignore SIGINT (the parent owns
shutdown) and die with their parent (PR_SET_PDEATHSIG on Linux, plus EOF on the pipe), so no
process outlives the run. `num_workers=0` calls the function inline, with no time bound: for
cheap trusted rewards such as the procedural tasks'.
"""

import collections
import concurrent.futures
import ctypes
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.tables import BUILTIN_REWARDS, Verdict, as_verdict, resolve_callable

log = logging.getLogger(__name__)

_READY = "ready"
_MAX_STARTUP_DEATHS = 3  # consecutive workers dying before their first task: give up


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (best effort elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # no prctl (not Linux): the parent's shutdown path still ends the worker


def _release_forkserver() -> None:
    """Drop this worker's handle on the fork server's "alive" pipe.

    Fork-server children inherit the write end of that pipe, so the server (our parent) lives
    as long as any worker does; a worker stuck in a hanging reward would then keep both alive
    after the run is killed. Without the handle the server exits with the run and
    PR_SET_PDEATHSIG takes the worker down with it.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass  # already closed
        server._forkserver_alive_fd = None


def failed_verdict(status: str, detail: str) -> Verdict:
    """What a task that timed out or failed resolves to (status "timeout" or "error")."""
    return Verdict(status=status, detail=detail)


def _call(fn: Callable, args: tuple, result: Callable) -> tuple[Any, str | None]:
    try:
        return result(fn(*args)), None
    except BaseException as e:  # SystemExit from user code is an error too, not an exit
        return None, f"{type(e).__name__}: {e}"[:300]


def _worker_main(conn, fn_ref, forkserver_child: bool, result: Callable = as_verdict) -> None:
    """Worker process: resolve the function, say ready, then serve tasks until EOF or None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if forkserver_child:
        _release_forkserver()
    try:
        fn = resolve_callable(fn_ref) if isinstance(fn_ref, str) else fn_ref
        conn.send((_READY, None, None))
    except BaseException as e:
        conn.send((_READY, None, f"{type(e).__name__}: {e}"[:300]))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, args = msg
        verdict, err = _call(fn, args, result)
        try:
            conn.send((task_id, verdict, err))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            conn.send((task_id, None, f"result not picklable: {e}"[:300]))
        except (BrokenPipeError, OSError):
            return


class _Worker:
    def __init__(self, ctx, fn_ref, result):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        forkserver_child = ctx.get_start_method() == "forkserver"
        self.process = ctx.Process(
            target=_worker_main,
            args=(child_conn, fn_ref, forkserver_child, result),
            name="reward-worker",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.ready = False
        self.task_id: int | None = None
        self.deadline = float("inf")
        self.served = 0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardPool:
    """Runs `reward_fn(*args) -> Verdict | float` in worker processes, one task per worker.

    reward_fn: a built-in name ("math", "task"), a "module.path:callable" string, or a
    picklable top-level function. `submit(*args)` returns a Future of a Verdict that always
    resolves: with the function's verdict, or `timeout` / `error` verdicts with reward 0.

    result / failure: for functions that return something else than a verdict (an
    environment's turn, envs/runner.py): `result(value)` normalises what the function returned
    (in the worker; raising makes it an error), `failure(status, detail)` is what a timeout or
    an error resolves to. Both must be picklable top-level functions.
    """

    def __init__(
        self,
        reward_fn: str | Callable,
        *,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        start_method: str = "forkserver",
        result: Callable = as_verdict,
        failure: Callable[[str, str], Any] = failed_verdict,
    ):
        if num_workers < 0:
            raise ConfigError(f"reward num_workers={num_workers} must be >= 0")
        if not timeout_s > 0:
            raise ConfigError(f"reward timeout_s={timeout_s} must be > 0")
        if isinstance(reward_fn, str):
            reward_fn = BUILTIN_REWARDS.get(reward_fn, reward_fn)
        fn = resolve_callable(reward_fn) if isinstance(reward_fn, str) else reward_fn
        if not callable(fn):
            raise ConfigError(f"reward function {reward_fn!r} is not callable")
        self._fn = fn
        self._fn_ref = reward_fn
        self._result, self._failure = result, failure
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.stats = collections.Counter()
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._closed = False
        self._broken: str | None = None
        if num_workers == 0:
            return
        if not isinstance(reward_fn, str):
            try:
                pickle.dumps(reward_fn)
            except Exception as e:
                raise ConfigError(
                    f"reward function {reward_fn!r} cannot be sent to worker "
                    f"processes ({e}); use a top-level function or a "
                    "'module:callable' string"
                ) from None
        if start_method not in multiprocessing.get_all_start_methods():
            raise ConfigError(
                f"reward start_method {start_method!r} is not available; use "
                f"one of {multiprocessing.get_all_start_methods()}"
            )
        self._ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            module = (
                reward_fn.split(":")[0]
                if isinstance(reward_fn, str)
                else getattr(reward_fn, "__module__", None)
            )
            # Only effective before the fork server starts; otherwise workers import lazily.
            self._ctx.set_forkserver_preload(["__main__"] + ([module] if module else []))
        self._workers: list[_Worker] = []
        self._wake_r, self._wake_w = os.pipe()
        # The manager thread also starts every worker: PR_SET_PDEATHSIG fires when the thread
        # that forked a child exits, so workers must come from a thread that lives as the pool.
        self._manager = threading.Thread(target=self._manage, name="reward-pool", daemon=True)
        self._manager.start()

    # ----- caller side -------------------------------------------------------------------

    def submit(self, *args) -> concurrent.futures.Future:
        """Schedules reward_fn(*args); the Future resolves to a Verdict, never raises."""
        future = concurrent.futures.Future()
        if self.num_workers == 0:
            verdict, err = _call(self._fn, args, self._result)
            future.set_result(verdict if err is None else self._error(err))
            self.stats[future.result().status] += 1
            return future
        with self._lock:
            if self._closed:
                raise RuntimeError("reward pool is closed")
            if self._broken:
                raise RuntimeError(f"reward workers cannot start: {self._broken}")
            task_id = next(self._ids)
            self._futures[task_id] = future
            self._pending.append((task_id, args))
        self._wake()
        return future

    def map(self, arg_tuples: Iterable[tuple]) -> list[Verdict]:
        """Verdicts of reward_fn(*args) for each args tuple, in order."""
        futures = [self.submit(*args) for args in arg_tuples]
        return [f.result() for f in futures]

    def worker_pids(self) -> list[int]:
        if self.num_workers == 0:
            return []
        with self._lock:
            return [w.process.pid for w in self._workers if w.process.pid is not None]

    def close(self) -> None:
        """Stops every worker (no orphans); unfinished tasks resolve as `error`."""
        if self.num_workers == 0:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._manager.join(timeout=30)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass  # already closed

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- manager thread ----------------------------------------------------------------

    def _error(self, detail: str):
        return self._failure("error", detail)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the wake pipe was closed during shutdown: nobody is left to wake

    def _resolve(self, task_id: int, verdict: Verdict) -> None:
        with self._lock:
            future = self._futures.pop(task_id, None)
        self.stats[verdict.status] += 1
        if future is not None and not future.done():
            future.set_result(verdict)

    def _spawn(self) -> _Worker:
        worker = _Worker(self._ctx, self._fn_ref, self._result)
        with self._lock:
            self._workers.append(worker)
        return worker

    def _retire(self, worker: _Worker, verdict: Verdict | None) -> None:
        """Kills a worker, resolves its task with verdict, and starts a replacement."""
        worker.kill()
        with self._lock:
            self._workers.remove(worker)
        if worker.served == 0 and worker.task_id is None and not worker.ready:
            self.stats["startup_deaths"] += 1
        giving_up = self.stats["startup_deaths"] >= _MAX_STARTUP_DEATHS and not self._closed
        replace = not giving_up and not self._closed and not self._broken
        # Counted before the verdict resolves, so whoever gets a timeout verdict reads stats
        # that already include its worker's replacement.
        if replace:
            self.stats["restarts"] += 1
        if worker.task_id is not None and verdict is not None:
            self._resolve(worker.task_id, verdict)
        if giving_up:
            self._give_up(f"{self.stats['startup_deaths']} workers died while starting")
        elif replace:
            self._spawn()

    def _died(self, worker: _Worker) -> None:
        worker.process.join(timeout=1.0)
        code = worker.process.exitcode
        self._retire(worker, self._error(f"reward worker died (exit code {code})"))

    def _give_up(self, reason: str) -> None:
        with self._lock:
            self._broken = reason
            pending = [task_id for task_id, _ in self._pending]
            self._pending.clear()
        for task_id in pending:
            self._resolve(task_id, self._error(f"reward workers unavailable: {reason}"))
        log.error("reward pool: %s", reason)

    def _on_message(self, worker: _Worker) -> None:
        try:
            task_id, verdict, err = worker.conn.recv()
        except (EOFError, OSError):
            self._died(worker)
            return
        if task_id == _READY:
            if err is not None:
                self._give_up(f"cannot load the reward function in a worker: {err}")
                self._retire(worker, None)
                return
            worker.ready = True
            self.stats["startup_deaths"] = 0
            return
        worker.task_id, worker.deadline = None, float("inf")
        worker.served += 1
        self._resolve(task_id, verdict if err is None else self._error(err))

    def _dispatch(self) -> None:
        with self._lock:
            idle = [w for w in self._workers if w.ready and w.task_id is None]
        for worker in idle:
            with self._lock:
                if not self._pending:
                    return
                task_id, args = self._pending.popleft()
            try:
                worker.conn.send((task_id, args))
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                self._resolve(task_id, self._error(f"arguments not picklable: {e}"[:300]))
                continue
            except OSError:  # the worker just died: requeue, its sentinel retires it
                with self._lock:
                    self._pending.appendleft((task_id, args))
                return
            worker.task_id = task_id
            worker.deadline = time.monotonic() + self.timeout_s

    def _manage(self) -> None:
        try:
            for _ in range(self.num_workers):
                self._spawn()
            while not self._closed:
                self._dispatch()
                now = time.monotonic()
                with self._lock:
                    workers = list(self._workers)
                deadline = min((w.deadline for w in workers), default=float("inf"))
                wait_s = None if deadline == float("inf") else max(0.0, deadline - now)
                handles = [self._wake_r] + [w.conn for w in workers]
                handles += [w.process.sentinel for w in workers]
                ready = multiprocessing.connection.wait(handles, timeout=wait_s)
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                for worker in workers:  # results first: a worker may answer, then exit
                    if worker.conn in ready and worker in self._workers:
                        self._on_message(worker)
                for worker in workers:
                    if worker.process.sentinel in ready and worker in self._workers:
                        self._died(worker)
                now = time.monotonic()
                for worker in workers:
                    if worker in self._workers and worker.deadline <= now:
                        self.stats["timeouts_killed"] += 1
                        self._retire(
                            worker,
                            self._failure("timeout", f"no verdict within {self.timeout_s:g} s"),
                        )
        except Exception as e:  # a bug here must not leave callers waiting on futures
            log.exception("reward pool manager failed")
            self._broken = f"reward pool manager failed: {type(e).__name__}: {e}"
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._workers)
            pending = [task_id for task_id, _ in self._pending]
            self._pending.clear()
        for worker in workers:
            try:
                if worker.task_id is None:
                    worker.conn.send(None)  # idle: let it exit by itself
            except OSError:
                pass  # its pipe is gone: the worker has exited already
        stop_by = time.monotonic() + 1.0
        for worker in workers:
            if worker.task_id is None:
                worker.process.join(timeout=max(0.0, stop_by - time.monotonic()))
            worker.kill()
            if worker.task_id is not None:
                self._resolve(worker.task_id, self._error("reward pool closed"))
        with self._lock:
            self._workers.clear()
            leftover = list(self._futures)
        for task_id in pending + leftover:
            self._resolve(task_id, self._error("reward pool closed"))
