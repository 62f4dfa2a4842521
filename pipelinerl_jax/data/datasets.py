"""Prompt datasets: local JSONL / JSON / Parquet files -> Problems -> a grain stream.

Loading reads every record of the file(s) once (prompt sets are small: the paper's 57k ORZ
problems are a few MB), maps it through a format (formats.py), and skips records without the
mapped fields, counting them per reason; a file where every record is bad is an error.

`PromptStream` is the iterator the pipeline draws prompts from: the shard's problems
(`[shard_index::shard_count]` of the source), shuffled with a seed and reshuffled every epoch
(grain's per-epoch seed), repeated for `num_epochs` or forever. Its state is one integer, the
position in the stream, so `get_state()` / `set_state()` continue exactly where a checkpoint
left off: over an epoch every problem of the shard is drawn once, none lost, none twice.
"""

import collections
import dataclasses
import glob
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import grain

from pipelinerl_jax.data.formats import Problem, get_format, to_problem
from pipelinerl_jax.errors import ConfigError

log = logging.getLogger(__name__)

_READERS = (".jsonl", ".json", ".parquet")


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """One dataset in the config: where it is, its format and optional field remapping."""

    path: str  # a file, a directory of files, or a glob pattern
    format: str = "fields"  # a name in formats.FORMATS
    name: str | None = None  # source name in uids and metrics; default: file stem
    question_field: str | None = None  # dotted path overriding the format's question field
    answer_field: str | None = None  # dotted path overriding the format's answer field


@dataclasses.dataclass(frozen=True)
class LoadedDataset:
    """Problems of a dataset and what had to be skipped to get them."""

    name: str
    problems: tuple[Problem, ...]
    num_records: int
    skipped: dict[str, int]  # reason -> count

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


def resolve_files(path: str) -> list[str]:
    """The data files a spec path names, sorted; a one-line ConfigError when there are none."""
    if any(ch in path for ch in "*?["):
        files = sorted(glob.glob(path))
    elif os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(_READERS))
    elif os.path.exists(path):
        files = [path]
    else:
        raise ConfigError(
            f"dataset file not found: {path} (check the dataset path in the "
            f"config; paths are relative to the working directory {os.getcwd()})"
        )
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise ConfigError(f"no dataset files ({', '.join(_READERS)}) match {path}")
    for f in files:
        if not f.endswith(_READERS):
            raise ConfigError(
                f"dataset file {f} has an unsupported extension; use one of {', '.join(_READERS)}"
            )
    return files


def read_records(path: str) -> list[Any]:
    """Raw records of one file. An unreadable JSONL line becomes None (a bad record)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # pyarrow is heavy; only Parquet users pay for it

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise ConfigError(f"cannot read Parquet file {path}: {e}") from None
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{path} is not valid JSON ({e}); JSON datasets hold one "
                    "list of records (use .jsonl for one record per line)"
                ) from None
            if not isinstance(data, list):
                raise ConfigError(
                    f"{path} holds a JSON {type(data).__name__}, expected a list of records"
                )
            return data
        records = []
        for line in f:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                records.append(None)
        return records


def load_problems(specs, where: str) -> list[Problem]:
    """The problems of every dataset in `specs` (the config field `where`, for messages), in
    order; two datasets of one name are refused, as their problems' uids (name/index) and
    per-source metrics would clash."""
    loaded = [load_dataset(spec) for spec in specs]
    names = [d.name for d in loaded]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ConfigError(
            f"config.{where}: two datasets are named {twice!r} (a name defaults to the file's "
            'stem), so their problems\' uids would clash: give each a distinct "name"'
        )
    return [p for d in loaded for p in d.problems]


def load_dataset(spec: DatasetSpec) -> LoadedDataset:
    """Reads and maps every record of `spec`; bad records are skipped, counted and logged."""
    fmt = get_format(spec.format)
    files = resolve_files(spec.path)
    name = spec.name or os.path.splitext(os.path.basename(files[0].rstrip("/")))[0]
    q_fields = (spec.question_field,) if spec.question_field else None
    a_fields = (spec.answer_field,) if spec.answer_field else None
    problems, skipped, row, first_bad = [], collections.Counter(), 0, None
    for path in files:
        for record in read_records(path):
            if record is None:
                result = "invalid JSON line"
            else:
                result = to_problem(
                    record,
                    fmt,
                    source=name,
                    row=row,
                    question_fields=q_fields,
                    answer_fields=a_fields,
                )
            if isinstance(result, Problem):
                problems.append(result)
            else:
                skipped[result] += 1
                if first_bad is None:
                    keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
                    first_bad = f"{result}; first bad record has {keys}"
            row += 1
    if not problems:
        raise ConfigError(
            f"dataset {spec.path}: none of its {row} records is usable as format "
            f"{fmt.name!r} ({first_bad or 'the file is empty'}); set format= or "
            "question_field=/answer_field= to match the records"
        )
    if skipped:
        log.warning(
            "dataset %s: skipped %d of %d records: %s",
            spec.path,
            sum(skipped.values()),
            row,
            dict(skipped),
        )
    return LoadedDataset(
        name=name, problems=tuple(problems), num_records=row, skipped=dict(skipped)
    )


def source_fingerprint(source: Sequence[Problem]) -> str:
    """Short digest identifying a source: its length and the uids of a few spread-out items.

    Sources may provide their own (`fingerprint()`, e.g. procedural tasks); a resumed iterator
    compares it so that a checkpoint's position is never applied to different data.
    """
    own = getattr(source, "fingerprint", None)
    if callable(own):
        return own()
    n = len(source)
    probe = sorted({0, n - 1, *range(0, n, max(1, n // 16))}) if n else []
    text = f"{n}|" + "|".join(source[i].uid for i in probe)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _stamp(index: int, problem: Problem, epoch_size: int) -> Problem:
    return dataclasses.replace(problem, epoch=index // epoch_size, index=index)


class PromptStream:
    """Sharded, per-epoch shuffled, repeated, checkpointable stream of Problems (grain)."""

    def __init__(
        self,
        source: Sequence[Problem],
        *,
        seed: int = 0,
        shuffle: bool = True,
        shard_index: int = 0,
        shard_count: int = 1,
        num_epochs: int | None = None,
    ):
        if shard_count < 1 or not 0 <= shard_index < shard_count:
            raise ConfigError(
                f"data shard {shard_index} of {shard_count} is invalid: need "
                "shard_count >= 1 and 0 <= shard_index < shard_count"
            )
        if num_epochs is not None and num_epochs < 1:
            raise ConfigError(f"num_epochs={num_epochs} must be >= 1 (or None for endless)")
        if not 0 <= seed < 2**32:
            raise ConfigError(f"data seed {seed} must be in [0, 2**32)")
        ds = grain.MapDataset.source(source)[shard_index::shard_count]
        self.epoch_size = len(ds)
        if self.epoch_size == 0:
            raise ConfigError(
                f"data shard {shard_index} of {shard_count} is empty: the "
                f"dataset has only {len(source)} problems"
            )
        if shuffle:
            ds = ds.shuffle(seed=seed)  # grain reseeds with seed + epoch: a new order per epoch
        epoch_size = self.epoch_size
        ds = ds.repeat(num_epochs).map_with_index(lambda i, p: _stamp(i, p, epoch_size))
        self._fingerprint = {
            "source": source_fingerprint(source),
            "seed": seed,
            "shuffle": shuffle,
            "shard_index": shard_index,
            "shard_count": shard_count,
        }
        # No prefetch threads: drawing a prompt is microseconds, and a state without
        # read-ahead is exactly the number of prompts handed out.
        options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self._iter = iter(ds.to_iter_dataset(options))
        self._next_index = 0

    def __iter__(self) -> "PromptStream":
        return self

    def __next__(self) -> Problem:
        problem = next(self._iter)
        self._next_index = problem.index + 1
        return problem

    @property
    def position(self) -> int:
        """Number of problems drawn so far from this shard's stream."""
        return self._next_index

    @property
    def epoch(self) -> int:
        """Epoch of the next problem to be drawn."""
        return self._next_index // self.epoch_size

    def get_state(self) -> dict:
        """JSON-serialisable state; `set_state` of it continues with the very next problem."""
        return {
            "next_index": self._next_index,
            "grain": self._iter.get_state(),
            **self._fingerprint,
        }

    def set_state(self, state: dict) -> None:
        for key, value in self._fingerprint.items():
            if state.get(key) != value:
                raise ConfigError(
                    f"data iterator state was saved for different data ({key}={state.get(key)!r}"
                    f", now {value!r}); resuming would break the data order: restore the "
                    "original dataset/seed/sharding or start a new workdir"
                )
        self._iter.set_state(state["grain"])
        self._next_index = int(state["next_index"])
