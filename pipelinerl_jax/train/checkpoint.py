"""Run checkpoints with Orbax: train state, pipeline bookkeeping, and the model's shape.

    ckpt = RunCheckpointer(workdir, keep=3, model_config=decoder.config_of(graphdef))
    restored = ckpt.restore_latest(abstract_state(trainer, abstract_params))  # pytree_dicts
    if restored is not None:
        step, state, extra = restored
        changes = check_compatible(extra["config"], config_lib.as_dict(cfg))  # resume_compat
    ...
    ckpt.save(step, state, {"config": ..., "data": stream.get_state(), ...})
    ckpt.close()                       # waits for the last asynchronous write

Layout: `<workdir>/checkpoints/<step>/` is one Orbax composite checkpoint with four items:
  params  TrainState.params as a nested dict of arrays (what export reads, alone)
  train   the rest of the TrainState: counters, optimizer moments, reference params
  extra   the caller's JSON dict (data iterator, admission counter, pending groups, config)
  meta    JSON: format version, step, ModelConfig, and the shape/dtype of every saved leaf
Orbax writes each step under a temporary name and renames it when complete, and keeps the
newest `keep` steps. On an accelerator saves are asynchronous: `save` returns once the arrays
are copied to host memory (the caller may donate them right away), the files are written in
the background. On CPU the device memory is the host memory, so that copy is a whole second
train state in the process, alive while the next train step runs; there saves are
synchronous and stream at most `save_inflight_bytes` through Orbax at a time (derived from
the model's largest leaf), and `save` returns once the files are written. For SmolLM2-135M's
1.5 GiB state: 0.19 GiB above the state for 1.6 s, against 1.81 GiB in the background
(`bench/bench_checkpoint_memory.py`, EPYC).

Pytrees are stored as nested dicts keyed by their tree paths (pytree_dicts.py), so they restore
into the caller's own structure, on the caller's shardings; the JSON items are made JSON-safe
first (json_items.py).

Restoring walks back from the newest step: a step whose files are missing, truncated or
unreadable is logged, moved aside to `<workdir>/checkpoints_corrupt/` (so that new saves with
the same step number and Orbax's keep-last-K never trip over it), and the previous one is
tried. A step whose leaves do not match the requested structure is not corrupt but a changed
config: that raises ConfigError instead of silently falling back.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.train.json_items import jsonable, model_config_to_json
from pipelinerl_jax.train.pytree_dicts import as_abstract, from_nested, leaf_manifest, to_nested

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "checkpoints_corrupt"
FORMAT_VERSION = 1
_ITEMS = ("params", "train", "extra", "meta")


def _not_read_only_notice(record: logging.LogRecord) -> bool:
    """Orbax warns "Given directory is read only" on every read-only open; here such opens are
    the intent (export, evaluation, the resume check before a run loads), not a problem."""
    return not str(record.msg).startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_not_read_only_notice)


def _split_state(state) -> tuple[Any, Any]:
    """TrainState -> (params, the rest with params removed)."""
    return state.params, state.replace(params=None)


class CorruptCheckpointError(RuntimeError):
    """A checkpoint step whose files are missing or unreadable."""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"


def _multi_process() -> bool:
    return jax.process_count() > 1


def _process_local(x) -> bool:
    """Whether a leaf must travel as a host copy: in a multi-process runtime Orbax refuses
    jax.Arrays that live on one process's devices (it expects global arrays), so a trainer on
    one process writes and reads numpy; a trainer spanning several processes (each holding
    shards of global arrays) goes through Orbax's own multi-process path."""
    sharding = getattr(x, "sharding", None)
    return _multi_process() and sharding is not None and sharding.is_fully_addressable


def _to_host(nested: dict) -> dict:
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)) if _process_local(x) else x, nested)


def on_cpu() -> bool:
    """Whether this process's devices are CPUs (device memory is then host memory)."""
    return all(d.platform == "cpu" for d in jax.local_devices())


# The least a synchronous save streams at a time, so that a small model's leaves still go
# through Orbax several at once.
_MIN_INFLIGHT_BYTES = 256 * 2**20


def inflight_bytes_for(model_config: ModelConfig) -> int:
    """Bytes a synchronous save may hold in flight for this model's train state: two of its
    largest leaves as f32 (the optimizer moments' dtype), at least _MIN_INFLIGHT_BYTES. Orbax
    refuses a leaf larger than the bound, so it must cover the largest."""
    _, abstract = decoder.abstract_init(model_config)
    largest = max(math.prod(x.shape) for x in jax.tree.leaves(abstract)) * 4
    return max(2 * largest, _MIN_INFLIGHT_BYTES)


def _processes(processes: Sequence[int] | None):
    """Orbax's barriers span the processes that checkpoint together: the trainer processes
    (default: this one alone), never the samplers, which hold nothing a resume needs and would
    be waited for forever."""
    if jax.process_count() == 1:
        return ocp.options.MultiprocessingOptions()
    group = {jax.process_index()} if processes is None else {int(p) for p in processes}
    return ocp.options.MultiprocessingOptions(primary_host=min(group), active_processes=group)


def _is_closed_loop_report(value) -> bool:
    return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


# Orbax's coroutine reading one array of a checkpoint; those of a failed restore are dropped
# unawaited, each with the same read error the restore already raised.
_ORBAX_ARRAY_READ = "_read_array_index_and_device_put"


def quiet_failed_restore_reports() -> None:
    """Drops the reports of a failed restore's leftovers from then on: after a restore from a
    damaged checkpoint fails, Orbax has closed its event loop while TensorStore still completes
    the reads it had started (each completion's callback finds the loop closed), and the other
    arrays' read coroutines are collected unawaited with the same read error. Each printed a
    traceback (tens to over a thousand lines under the one-line warning that names the step);
    nothing else is hidden: other errors reach the hooks as before."""
    if getattr(sys.excepthook, "_quiets_closed_loop", False):
        return
    previous_except, previous_unraisable = sys.excepthook, sys.unraisablehook

    def excepthook(kind, value, tb):
        if not _is_closed_loop_report(value):
            previous_except(kind, value, tb)

    def unraisablehook(report):
        leftover = getattr(report.object, "__name__", None) == _ORBAX_ARRAY_READ
        if not (leftover or _is_closed_loop_report(report.exc_value)):
            previous_unraisable(report)

    excepthook._quiets_closed_loop = True
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


class RunCheckpointer:
    """Saves and restores a run's TrainState plus a JSON dict under `<workdir>/checkpoints`."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        keep: int = 3,
        model_config: ModelConfig | None = None,
        async_save: bool | None = None,
        save_inflight_bytes: int | None = None,
        read_only: bool = False,
        processes: Sequence[int] | None = None,
    ):
        """processes: in a multi-process run, the ids of the processes that save and restore
        together (the trainer processes); default this process alone.

        async_save: write in the background from a host copy (default: unless this process's
        devices are CPUs, module docstring). save_inflight_bytes: what a save streams through
        Orbax at once (default: unbounded when asynchronous, else `inflight_bytes_for` the
        model_config when one is given); it must cover the largest leaf saved."""
        if keep < 1:
            raise ConfigError(f"checkpoint_keep={keep} must be >= 1")
        if async_save is None:
            # A read-only opener never saves: it must not start JAX's backend to find out
            # (a launch's preflight reads checkpoints before jax.distributed is set up).
            async_save = False if read_only else not on_cpu()
        if save_inflight_bytes is None and not async_save and model_config is not None:
            save_inflight_bytes = inflight_bytes_for(model_config)
        self.async_save = async_save
        self.save_inflight_bytes = save_inflight_bytes
        self.workdir = Path(workdir)
        self.directory = self.workdir / CHECKPOINT_DIR
        self.model_config = model_config
        self.read_only = read_only
        # Of several processes checkpointing together, only the first moves bad steps aside.
        self._mover = processes is None or jax.process_index() == min(processes)
        if read_only and not self.directory.is_dir():
            self._manager = None
            return
        if not read_only:
            self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            save_interval_steps=0 if read_only else 1,
            # Orbax refuses to create the directory with active_processes set: then we do.
            create=not read_only and jax.process_count() == 1,
            read_only=read_only,
            enable_async_checkpointing=async_save,
            # Writes cut short (a killed run) leave "<step>.orbax-checkpoint-tmp-*" directories:
            # never listed as steps, and removed when the next run opens the directory.
            cleanup_tmp_directories=not read_only,
            multiprocessing_options=_processes(processes),
        )
        # Orbax's bound is in units of 10^9 bytes.
        bound = (
            {} if save_inflight_bytes is None else {"save_concurrent_gb": save_inflight_bytes / 1e9}
        )
        handlers = {
            "params": ocp.StandardCheckpointHandler(**bound),
            "train": ocp.StandardCheckpointHandler(**bound),
            "extra": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(
            self.directory.absolute(), options=options, item_handlers=handlers
        )

    # -- bookkeeping --

    def steps(self) -> list[int]:
        """Completed checkpoint steps, oldest first (unfinished writes are not listed)."""
        if self._manager is None:
            return []
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def wait(self) -> None:
        """Blocks until the last asynchronous save is on disk."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    def __enter__(self) -> RunCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- save --

    def save(self, step: int, train_state, extra: dict) -> bool:
        """Checkpoints `train_state` and the JSON dict `extra` as step `step`.

        Returns False (and writes nothing) when that step is already saved. Returns once the
        arrays are copied off the device (asynchronous) or written (synchronous: on CPU); call
        wait()/close() before relying on the files.
        """
        if self._manager is None or self.read_only:
            raise RuntimeError(f"checkpointer for {self.directory} is read-only")
        step = int(step)
        extra = jsonable(dict(extra), "")
        if step in self._manager.all_steps():
            log.info("checkpoint step %d already saved in %s", step, self.directory)
            return False
        params, rest = _split_state(train_state)
        self._check_bound(train_state)
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "saved_at": time.time(),
            "model_config": (
                model_config_to_json(self.model_config) if self.model_config is not None else None
            ),
            "leaves": {"params": leaf_manifest(params), "train": leaf_manifest(rest)},
            "versions": {"jax": jax.__version__, "orbax": ocp.__version__},
        }
        saved = self._manager.save(
            step,
            force=True,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(_to_host(to_nested(params))),
                train=ocp.args.StandardSave(_to_host(to_nested(rest))),
                extra=ocp.args.JsonSave(extra),
                meta=ocp.args.JsonSave(meta),
            ),
        )
        return bool(saved)

    def _check_bound(self, train_state) -> None:
        """Orbax fails a save mid-write on a leaf larger than its in-flight bound: refuse
        before anything is written."""
        if self.save_inflight_bytes is None:
            return
        leaves = jax.tree_util.tree_leaves_with_path(train_state)
        path, leaf = max(leaves, key=lambda kv: kv[1].nbytes, default=(None, None))
        if leaf is not None and leaf.nbytes > self.save_inflight_bytes:
            raise ConfigError(
                f"checkpoint: leaf {jax.tree_util.keystr(path)} has {leaf.nbytes} bytes, more "
                f"than save_inflight_bytes={self.save_inflight_bytes}; give the checkpointer "
                "the model_config of this state or a save_inflight_bytes of at least that"
            )

    # -- restore --

    def _path(self, step: int) -> Path:
        return self.directory / str(step)

    def read_json(self, step: int, item: str) -> dict:
        """The `extra` or `meta` dict of a step; CorruptCheckpointError if unreadable."""
        if self._manager is None:
            raise CorruptCheckpointError(f"no checkpoints in {self.directory}")
        try:
            value = getattr(
                self._manager.restore(
                    step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()})
                ),
                item,
            )
        except Exception as e:  # orbax/tensorstore raise many types for damaged files
            raise CorruptCheckpointError(f"{self._path(step)}: {item}: {_one_line(e)}") from e
        if not isinstance(value, dict):
            raise CorruptCheckpointError(f"{self._path(step)}: {item} is not a JSON object")
        return value

    def _check_leaves(self, step: int, meta: dict, item: str, target) -> None:
        saved = meta.get("leaves", {}).get(item)
        if not isinstance(saved, dict):
            raise CorruptCheckpointError(f"{self._path(step)}: meta has no leaf list for {item}")
        wanted = leaf_manifest(target)
        fix = (
            "the config changed the model or optimizer since this checkpoint; resume with "
            "the original config or start a new --workdir"
        )
        for name in sorted(set(saved) | set(wanted)):
            if name not in saved:
                raise ConfigError(
                    f"checkpoint {self._path(step)} has no {item} leaf {name!r} that "
                    f"the run needs: {fix}"
                )
            if name not in wanted:
                raise ConfigError(
                    f"checkpoint {self._path(step)} has a {item} leaf {name!r} the "
                    f"run does not have: {fix}"
                )
            if list(saved[name]) != wanted[name]:
                raise ConfigError(
                    f"checkpoint {self._path(step)}: {item} leaf {name!r} is {saved[name][1]}"
                    f"{tuple(saved[name][0])}, the run expects {wanted[name][1]}"
                    f"{tuple(wanted[name][0])}: {fix}"
                )

    def _restore_items(self, step: int, targets: dict) -> dict:
        """Restores the array items in `targets` (name -> abstract pytree) plus extra."""
        meta = self.read_json(step, "meta")
        for item, target in targets.items():
            self._check_leaves(step, meta, item, target)
        abstract = {item: as_abstract(t) for item, t in targets.items()}
        # Process-local leaves are restored as host arrays (see _process_local), placed after.
        host = lambda a: np.zeros(a.shape, a.dtype) if _process_local(a) else a
        wanted = {item: jax.tree.map(host, t) for item, t in abstract.items()}
        args = {item: ocp.args.StandardRestore(to_nested(t)) for item, t in wanted.items()}
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**args, extra=ocp.args.JsonRestore())
            )
            out = {item: from_nested(getattr(restored, item), t) for item, t in targets.items()}
            place = lambda x, a: jax.device_put(x, a.sharding) if _process_local(a) else x
            out = {item: jax.tree.map(place, v, abstract[item]) for item, v in out.items()}
            extra = restored.extra
        except Exception as e:
            raise CorruptCheckpointError(f"{self._path(step)}: {_one_line(e)}") from e
        if not isinstance(extra, dict):
            raise CorruptCheckpointError(f"{self._path(step)}: extra is not a JSON object")
        out["extra"], out["meta"] = extra, meta
        return out

    def restore(self, step: int, abstract_train_state) -> tuple[Any, dict]:
        """(train_state, extra) of one step, on the target's shardings.

        Raises CorruptCheckpointError for damaged files, ConfigError for a structure mismatch.
        """
        params, rest = _split_state(abstract_train_state)
        out = self._restore_items(step, {"params": params, "train": rest})
        return out["train"].replace(params=out["params"]), out["extra"]

    def restore_params(self, step: int, abstract_params) -> Any:
        """Only the params of one step (export, evaluation): the optimizer state is not read."""
        return self._restore_items(step, {"params": abstract_params})["params"]

    def restore_latest(self, abstract_train_state) -> tuple[int, Any, dict] | None:
        """(step, train_state, extra) of the newest readable step, or None (with a warning).

        `abstract_train_state`: a TrainState of jax.ShapeDtypeStruct with shardings (see
        `abstract_state`) or of arrays; values are restored directly onto those shardings.
        Unreadable steps are skipped with a warning and moved to `<workdir>/checkpoints_corrupt`.
        """
        return self._latest(lambda step: (step, *self.restore(step, abstract_train_state)))

    def restore_latest_params(self, abstract_params) -> tuple[int, Any] | None:
        """(step, params) of the newest readable step, or None; as restore_latest."""
        return self._latest(lambda step: (step, self.restore_params(step, abstract_params)))

    def _latest(self, restore_one):
        steps = self.steps()
        if not steps:
            log.info("no checkpoint in %s: starting fresh", self.directory)
            return None
        bad = []
        result = None
        for step in reversed(steps):
            try:
                result = restore_one(step)
                break
            except CorruptCheckpointError as e:
                quiet_failed_restore_reports()
                log.warning(
                    "checkpoint step %d is corrupt or incomplete (%s); trying the previous one",
                    step,
                    e,
                )
                bad.append(step)
        for step in bad:
            self._quarantine(step)
        if result is None:
            log.warning(
                "none of the %d checkpoints in %s is readable: starting fresh",
                len(steps),
                self.directory,
            )
        elif bad:
            log.warning(
                "resuming from checkpoint step %d (newer steps %s were unreadable)",
                result[0],
                sorted(bad),
            )
        return result

    def _quarantine(self, step: int) -> None:
        """Moves a bad step out of Orbax's directory (keeps it for inspection)."""
        if self.read_only or not self._mover:
            return
        src = self._path(step)
        dest_dir = self.workdir / CORRUPT_DIR
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / f"{step}-{int(time.time())}"
        n = 0
        while dest.exists():
            n += 1
            dest = dest_dir / f"{step}-{int(time.time())}-{n}"
        try:
            shutil.move(str(src), str(dest))
            log.warning("moved unreadable checkpoint %s to %s", src, dest)
        except OSError as e:
            log.warning("could not move unreadable checkpoint %s aside: %s", src, e)
        self._manager.reload()
