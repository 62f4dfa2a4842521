"""The two loops of PipelineRL and their hand-offs: a sampler thread and a trainer thread.

Sampler thread, at every chunk boundary:
  1. take staged weights if newer ones arrived (a reference swap: the KV cache stays);
  2. start new groups while admission's lag budget allows (admission.py);
  3. run one decode chunk; collect finished attempts; a full group goes to the reward pool,
     whose callback posts it, scored, on the ReadyBoard.
With an environment (episodes.py), a finished attempt is one turn: it goes to the
environment, and its answer resumes the episode at a later chunk boundary; a group is
complete, and scored by its environment, when all of its episodes have ended.
Trainer thread, per optimizer step s:
  1. wait for the groups of step s (start order), build the packed batch;
  2. dispatch train_step, then publish the new params to the sampler (async copy);
  3. wait for the step, log its metrics, evaluate if due, then `on_step_end` (checkpoints).
The record of step s is on disk before step s counts as done: a checkpoint after step s
(saved by `on_step_end`) never holds a step whose record a kill could still lose.

Either thread's exception stops both; `run()` re-raises it once, naming the thread it came
from. Ctrl-C stops both as well. Nothing blocks without a timeout, so shutdown takes at most
one decode chunk or one train step.

The sampler is used through the `sampler.protocol.Sampler` members only (submit, has_work,
step, set_params, version, num_slots; the Publisher calls its prepare), so any implementation
of the protocol can generate for a run. The prompt stream is any iterator of Problems; its
position is checkpointed when it has get_state/set_state (data.prompts.CheckpointableStream).
"""

from __future__ import annotations

import threading
import time
import traceback

import jax
import numpy as np

from pipelinerl_jax import glibc_malloc, interrupts
from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import determinism, step_record
from pipelinerl_jax.pipeline import snapshot as snapshot_lib
from pipelinerl_jax.pipeline.episodes import Episode
from pipelinerl_jax.pipeline.filtering import GroupFilter
from pipelinerl_jax.pipeline.groups import Group, ReadyBoard
from pipelinerl_jax.rl.batch import build_batch
from pipelinerl_jax.sampler.protocol import Sampler
from pipelinerl_jax.sampler.sequence import SamplingParams
from pipelinerl_jax.train.trainer import check_skips


class PipelineError(RuntimeError):
    """A pipeline thread failed; the message names the thread and the original error."""


class Coordinator:
    """Runs sampler and trainer concurrently for `cfg.steps` optimizer steps."""

    def __init__(
        self,
        cfg,
        *,
        sampler: Sampler,
        trainer,
        state,
        stream,
        encode_prompt,
        detokenize,
        reward_pool,
        reward_table,
        publisher,
        admission,
        writer,
        start_step=0,
        on_step_end=None,
        evaluator=None,
        compile_watch=None,
        diagnostics=None,
        episodes=None,
    ):
        self.cfg = cfg
        self.sampler, self.trainer, self.state = sampler, trainer, state
        self.stream, self.encode_prompt, self.detokenize = stream, encode_prompt, detokenize
        self.reward_pool, self.reward_table = reward_pool, reward_table
        self.publisher, self.admission, self.writer = publisher, admission, writer
        self.step = start_step
        self.on_step_end = on_step_end
        self.evaluator = evaluator
        self.compile_watch = compile_watch  # compile_watch.CompileWatch: compilations per step
        self.diagnostics = diagnostics  # diagnostics.RewardDiagnostics: statuses, samples
        self.episodes = episodes  # episodes.EpisodeDriver: attempts are multi-turn episodes
        if episodes is not None and not all(hasattr(sampler, m) for m in ("resume", "release")):
            raise ConfigError(
                f"config.env needs a sampler that runs episodes (submit(episode=True), resume, "
                f"release); {type(sampler).__name__} does not: use PagedSampler"
            )
        self.board = ReadyBoard()
        self.filter = GroupFilter.from_config(cfg.batch, admission.groups_per_step)
        self.next_index = start_step * admission.groups_per_step  # the next group to train
        self.stop = threading.Event()
        self._errors: list[tuple[str, BaseException, str]] = []
        self._errors_lock = threading.Lock()
        self.open_groups: dict[int, Group] = {}  # started, not yet fully generated
        self.pending: dict[int, Group] = {}  # started, not yet trained (what resume keeps)
        self.requeue: list[Group] = []  # resumed groups to regenerate first
        self._draw_lock = threading.Lock()  # stream draw + registration are one step
        self.sampling = SamplingParams(
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
        )
        # Timing, for busy fractions and the swap pause.
        self.t_start = None
        self.sampler_busy_s = 0.0
        self.trainer_busy_s = 0.0
        self.trainer_wait_s = 0.0
        self.swap_pause_s: list[float] = []  # time the sampler spent swapping, per swap
        self.swap_latency_s: list[float] = []  # staged -> first chunk with them done
        self.samples_generated = 0
        self._pending_swap_t: float | None = None
        self._handed_version = sampler.version  # see hand_params
        self._stream_ended = False
        self._done: list[threading.Event] = []  # one per thread, set when it ends
        # config.deterministic (determinism.py): built by run(), after a resume's restore.
        self.deterministic: determinism.Deterministic | None = None
        self.drain_every = 0  # deterministic: checkpoint_every when checkpoints are saved
        self.steps_ended = start_step  # steps whose on_step_end (checkpoint) has run

    # --- threads ------------------------------------------------------------------------

    def _guard(self, name, fn):
        done = threading.Event()
        self._done.append(done)

        def target():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported once by run()
                with self._errors_lock:
                    self._errors.append((name, e, traceback.format_exc()))
                self.stop.set()
            finally:
                done.set()

        return threading.Thread(target=target, name=name, daemon=True)

    def run(self) -> None:
        """Runs to completion; raises PipelineError (or KeyboardInterrupt) on failure."""
        self.t_start = time.perf_counter()
        self.steps_ended = self.step
        if self.cfg.deterministic:
            self.deterministic = determinism.Deterministic(
                self,
                swap_chunks=self.cfg.swap_chunks or determinism.derived_swap_chunks(self.cfg),
                drain_every=self.drain_every,
            )
        threads = [
            self._guard("sampler", self._sampler_loop),
            self._guard("trainer", self._trainer_loop),
        ]
        for t in threads:
            t.start()
        try:
            while not self.stopped():
                self._wait(0.05)
                if self._errors:
                    self.stop.set()
        except KeyboardInterrupt:
            interrupts.received()
            self.stop.set()
            self._wait(30)
            raise
        self.stop.set()
        self._wait(30)
        if self._errors:
            name, exc, tb = self._errors[0]
            raise PipelineError(f"{name} thread failed: {type(exc).__name__}: {exc}\n{tb}") from exc

    def _wait(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for both threads to end. On each thread's own event, not
        Thread.join: a KeyboardInterrupt that lands inside join() makes CPython 3.11 mark the
        thread as stopped while it still runs (bpo-45274), so every later join() returned at
        once and a Ctrl-C'd run went on with its trainer mid-step."""
        deadline = time.monotonic() + timeout_s
        for done in self._done:
            done.wait(max(0.0, deadline - time.monotonic()))

    def stopped(self) -> bool:
        """True once both threads have ended: state, step and snapshot() no longer change."""
        return bool(self._done) and all(done.is_set() for done in self._done)

    # --- sampler ------------------------------------------------------------------------

    def _sampler_version(self) -> int:
        """The version the next decode chunk will use (params handed over but not yet swapped
        count: the sampler swaps them before its next chunk)."""
        return max(self.sampler.version, self._handed_version)

    def hand_params(self, params, version: int, *, prepared: bool = False) -> None:
        """Gives the sampler the params of `version` (Sampler.set_params: swapped in at its
        next chunk) and counts them from now on: admission may start groups at `version`
        before the swap, since every token of those groups is decoded after it. A resume
        calls it before run() with the checkpoint's params; the sampler thread calls it with
        each published version."""
        self.sampler.set_params(params, version, prepared=prepared)
        self._handed_version = max(self._handed_version, int(version))

    def _take_weights(self, wait_s: float = 0.0) -> None:
        current = self._sampler_version()
        staged = (
            self.publisher.wait_newer(current, wait_s)
            if wait_s
            else self.publisher.take_newer(current)
        )
        if staged is not None:
            self.swap_in(staged)

    def swap_in(self, staged) -> None:
        """Hands the sampler a staged version (pipeline/weights.py), timing the swap."""
        t0 = time.perf_counter()
        self.hand_params(staged.params, staged.version, prepared=True)
        self.swap_pause_s.append(time.perf_counter() - t0)
        self._pending_swap_t = staged.staged_at

    def _start_groups(self) -> None:
        g = self.cfg.group_size
        # Keep one group queued beyond the slots so a freed slot is refilled at once. An
        # episode waiting for its environment holds no slot, so it does not count.
        waiting = self.episodes.with_env if self.episodes is not None else 0
        while len(self.open_groups) * g - waiting < self.sampler.num_slots + g:
            with self._draw_lock:
                if self.requeue:  # prompts in flight at the checkpoint: regenerated first
                    group = self.requeue.pop(0)
                else:
                    if self._stream_ended:
                        return
                    index = self.admission.try_start(
                        self._sampler_version(),
                        det.schedule.admission_limit() if (det := self.deterministic) else None,
                    )
                    if index is None:
                        return
                    problem = self._draw(index)
                    if problem is None:
                        return
                    group = Group(
                        index=index, problem=problem, prompt_ids=self.encode_prompt(problem)
                    )
                self.open_groups[group.index] = group
                self.pending[group.index] = group
            if self.episodes is not None:
                self.episodes.submit(
                    self.sampler,
                    group.problem,
                    group.prompt_ids,
                    n=g,
                    params=self.sampling,
                    request_id=group.index,
                )
            else:
                self.sampler.submit(
                    group.prompt_ids, n=g, params=self.sampling, request_id=group.index
                )

    def _draw(self, index: int) -> Problem | None:
        """The prompt of group `index` (under the draw lock), or None once a finite stream has
        run dry after every group the run trains has started."""
        try:
            problem = next(self.stream)
        except StopIteration:
            needed = self.cfg.steps * self.admission.groups_per_step
            if index - self.admission.dropped < needed:
                raise RuntimeError(
                    f"the prompt stream ended after {index} prompts; {self.cfg.steps} steps "
                    f"train {needed}: pass a longer (or endless) stream"
                ) from None
            # Admission let the run start groups it will never train (the lag budget runs
            # ahead of the last step): un-start this one, so a checkpoint counts only real ones.
            self.admission.restore(index)
            self._stream_ended = True
            return None
        if not isinstance(problem, Problem):
            raise TypeError(
                f"the prompt stream yielded a {type(problem).__name__}; it must yield "
                "pipelinerl_jax.data.formats.Problem (uid, question, answer, source)"
            )
        return problem

    def _sampler_loop(self) -> None:
        episodes, det = self.episodes, self.deterministic
        while not self.stop.is_set():
            if det is None:
                self._take_weights()
            elif not det.before_chunk():  # the due swap and checkpoint drains, by counts
                break
            if episodes is not None:
                for episode in episodes.advance(self.sampler):
                    self._collect_episode(episode)
            self._start_groups()
            if not self.sampler.has_work():
                if episodes is not None and episodes.with_env:
                    episodes.wait(0.05)  # every open episode waits for its environment
                elif det is not None:  # the next version at once, in order
                    det.take(self._sampler_version() + 1)
                else:  # lag budget spent: nothing may start until the trainer publishes
                    self._take_weights(wait_s=0.05)
                continue
            t0 = time.perf_counter()
            finished = self.sampler.step()
            t1 = time.perf_counter()
            self.sampler_busy_s += t1 - t0
            if det is not None:
                det.schedule.ran_chunk()
            if self._pending_swap_t is not None:
                self.swap_latency_s.append(t1 - self._pending_swap_t)
                self._pending_swap_t = None
            for sample in finished:
                if episodes is None:
                    self._collect(sample)
                    continue
                self._check_started(sample)
                episode = episodes.on_sample(sample)
                if episode is not None:
                    self._collect_episode(episode)

    def _check_started(self, sample) -> None:
        """A request the sampler refused outright (its prompt) is a configuration error."""
        if sample.finish_reason == "error" and len(sample.token_ids) == 0:
            raise RuntimeError(f"sampler rejected group {sample.request_id}: {sample.error}")

    def _collect_episode(self, episode: Episode) -> None:
        group = self.open_groups[episode.sample.request_id]
        group.episodes.append(episode)
        self.samples_generated += 1
        if len(group.episodes) < self.cfg.group_size:
            return
        del self.open_groups[group.index]
        group.episodes.sort(key=lambda e: e.sample.attempt)
        group.samples = [e.sample for e in group.episodes]
        self._score(group, [e.verdict() for e in group.episodes])

    def _collect(self, sample) -> None:
        self._check_started(sample)
        group = self.open_groups[sample.request_id]
        group.samples.append(sample)
        self.samples_generated += 1
        if len(group.samples) < self.cfg.group_size:
            return
        del self.open_groups[group.index]
        group.samples.sort(key=lambda s: s.attempt)
        futures = [
            self.reward_pool.submit(self.detokenize(s.token_ids), group.problem)
            for s in group.samples
        ]
        if self.deterministic is not None:  # scored at this chunk boundary, in finish order
            self._score(group, [f.result() for f in futures])
            return
        remaining = [len(futures)]
        lock = threading.Lock()

        def done(_):
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            self._score(group, [f.result() for f in futures])

        for f in futures:
            f.add_done_callback(done)

    def _score(self, group: Group, verdicts) -> None:
        group.verdicts = list(verdicts)
        group.rewards = [
            self.reward_table.compute(
                v,
                num_tokens=sum(v >= 0 for v in s.versions),  # model tokens
                max_tokens=self.cfg.max_new_tokens,
                finished=f,
            ).reward
            for v, s, f in zip(verdicts, group.samples, group.finished())
        ]
        det = self.deterministic
        # Deterministic: steps begun as the sampler counts them, not as the trainer has.
        begun = self.step if det is None else self._sampler_version()
        if self.filter is not None and self.filter.drops(group, begun):
            with self._draw_lock:  # never trained: its slot starts a refill
                del self.pending[group.index]
                self.admission.drop()
            group.dropped, group.samples, group.episodes = True, [], []
        if det is not None:
            det.schedule.scored(group.index, not group.dropped)
        self.board.put(group)

    # --- trainer ------------------------------------------------------------------------

    def _trainer_loop(self) -> None:
        if self.evaluator is not None and self.step == 0 and self.cfg.eval.at_start:
            self._evaluate()  # the starting policy: what the run's curve starts from
        while self.step < self.cfg.steps and not self.stop.is_set():
            t0 = time.perf_counter()
            adm = self.admission
            g = adm.groups_per_step
            if adm.mode == "conventional" and self.step % adm.round_steps == 0:
                # Conventional RL: the whole round is generated before its first step.
                if not self.board.wait_kept(self.next_index, adm.round_steps * g, self.stop):
                    break
            taken = self.board.take_kept(self.next_index, g, self.stop)
            if taken is None:
                break
            groups, dropped, self.next_index = taken
            with self._draw_lock:
                for g in groups:
                    del self.pending[g.index]
            t1 = time.perf_counter()
            self.trainer_wait_s += t1 - t0
            samples = [s for g in groups for s in g.train_samples()]
            batch, host_stats = build_batch(samples, self.cfg.batch)
            if self.cfg.trim_host_memory:
                # Between two steps the decode chunks' small temporaries fragment the heap the
                # last step's freed: a step starting from what is live peaks lower. The last
                # publish's copies must be gone first, or their pages come free only after.
                self.publisher.wait_prepared()
                glibc_malloc.release()
            self.state, device_metrics = self.trainer.train_step(self.state, batch)
            version = self.step + 1
            self.publisher.publish(self.state.params, version)
            record = step_record.host_record(self, self.step, groups, batch, host_stats)
            if self.filter is not None:
                record.update(self.filter.record(dropped))
            if self.deterministic is not None:
                record["replay/batch_crc"] = determinism.batch_crc(batch)
            # Busy until the step has run, not until it was dispatched: the trainer thread has
            # nothing else to do meanwhile (its next batch comes from the sampler), and a
            # dispatch-time figure made a long step look several times shorter.
            jax.block_until_ready(device_metrics)
            record["time/train_s"] = time.perf_counter() - t1
            record["time/wait_s"] = t1 - t0
            self.trainer_busy_s += time.perf_counter() - t1
            # Logged before the step counts as done: a resume from the checkpoint on_step_end
            # may save next starts after this step, so a record written later could be lost.
            self._log(self.step, device_metrics, record)
            self.step = version
            if self.evaluator is not None and (
                self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps
            ):
                self._evaluate()  # before the checkpoint too: a resume never re-evaluates
            if self.on_step_end is not None:
                self.on_step_end(self)
            self.steps_ended = self.step
        self.stop.set()  # training is done: the sampler stops at its next chunk boundary

    def _evaluate(self) -> None:
        """Held-out evaluation of the current params (the trainer pauses meanwhile)."""
        t0 = time.perf_counter()
        result = self.evaluator(self.state.params, self.step)
        record = {
            "step": self.step,
            "eval_s": time.perf_counter() - t0,
            **{k: v for k, v in result.items() if k != "samples"},
        }
        self.writer.write("eval", record)
        self.writer.echo(
            f"eval at step {self.step}: avg@{result['k']} {result['avg@k']:.3f} "
            f"pass@{result['k']} {result['pass@k']:.3f} "
            f"({result['num_problems']} held-out problems)" + _answered(result)
        )

    def snapshot(self) -> dict:
        """JSON-able bookkeeping for a checkpoint taken after the current step (snapshot.py)."""
        return snapshot_lib.take(self)

    def restore(self, snap: dict) -> None:
        """Inverse of snapshot(), before run() (snapshot.py); a ConfigError, with nothing
        changed, when the stream's position cannot be restored."""
        snapshot_lib.restore(self, snap)

    def _log(self, step, device_metrics, record) -> None:
        fetched = jax.device_get(device_metrics)
        check_skips(fetched, self.cfg.trainer.max_consecutive_skips)
        for key, value in fetched.items():
            if np.ndim(value) == 0 and not key.startswith("lag/"):
                record.setdefault(key, float(value))
        self.writer.write("train", record)


def _answered(result: dict) -> str:
    """', answered 0.40' (a parsed final answer, right or wrong) when statuses were counted."""
    status = result.get("status")
    n = sum(status.values()) if status else 0
    return f", answered {(status['correct'] + status['wrong']) / n:.2f}" if n else ""
