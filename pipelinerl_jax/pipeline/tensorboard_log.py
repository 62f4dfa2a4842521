"""TensorBoard event files for a run: every scalar of each train and eval record, by step.

    tb = TensorBoardLog(Path(workdir) / "tensorboard")
    tb.purge_step = 40            # a run resumed from its step-40 checkpoint (before any write)
    tb.write("train", record)     # tags train/reward/mean, train/lag/hist/0, ...
    tb.close()

`tensorboard --logdir <workdir>` shows them. Tags are `<kind>/<key>`, nested dicts flattened
(`train/lag/hist/4-5`, `eval/status/correct`); strings and lists (the prompts) are left out.
TensorBoard allows only letters, digits and `_ . / -` in tags: `@` is spelled `_at_`
(`eval/avg_at_k`), `+` `_plus` (`train/lag/hist/32_plus`), anything else `_`.
The events are written by tensorboardX (TensorBoard's own file format, no TensorFlow needed) and
flushed after every record, so a killed run keeps what it logged, as metrics.jsonl does.

A run opens its event file with TensorBoard's purge marker at `purge_step` (0 for a fresh run,
the checkpoint's step on resume): TensorBoard then drops what earlier files logged at that
step or later, i.e. the steps a killed run trained after its last checkpoint, which the
resumed run trains again. Without it those steps would show twice.

tensorboardX's writer imports torch whenever it is installed (to accept torch tensors), which
cost a run 1.0 s of start-up and 190 MB of resident memory for nothing: records hold Python
and numpy numbers. `summary_writer_class` imports tensorboardX with torch hidden.
"""

from __future__ import annotations

import logging
import numbers
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np

_SPELLED = str.maketrans({"@": "_at_", "+": "_plus"})
_NOT_IN_TAGS = re.compile(r"[^-/\w.]")


_IMPORT_LOCK = threading.Lock()


def summary_writer_class():
    """tensorboardX's SummaryWriter, imported without importing torch (unless torch already is).

    While tensorboardX imports, sys.modules maps "torch" to None, so its `import torch` raises
    ImportError and it falls back to numpy; the entry is removed after, so a later
    `import torch` anywhere works as usual."""
    with _IMPORT_LOCK:
        hide = "torch" not in sys.modules and "tensorboardX" not in sys.modules
        if hide:
            sys.modules["torch"] = None
        try:
            from tensorboardX import SummaryWriter
        finally:
            if hide:
                del sys.modules["torch"]
        return SummaryWriter


def tag_of(key: str) -> str:
    """A record key as a TensorBoard tag (letters, digits and `_ . / -` only)."""
    return _NOT_IN_TAGS.sub("_", str(key).translate(_SPELLED))


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """{tag: value} for every number in `record` (nested dicts joined with "/"); `kind` and
    `step` are the tag prefix and the x axis, not values."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key in ("kind", "step"):
            continue
        tag = prefix + tag_of(key)
        if isinstance(value, dict):
            out.update(scalars(value, tag + "/"))
        elif isinstance(value, (bool, np.bool_, numbers.Real)):
            out[tag] = float(value)
    return out


class TensorBoardLog:
    """Writes records as TensorBoard scalars under `logdir`; opened on the first write."""

    def __init__(self, logdir: str | Path):
        self.logdir = Path(logdir)
        self.purge_step = 0
        self._writer = None

    def _open(self):
        # Imported here: only runs with a workdir pay for it.
        SummaryWriter = summary_writer_class()  # noqa: N806 - a class

        # tensorboardX warns on every NaN scalar (a step whose loss was skipped logs NaN):
        # TensorBoard draws NaN as a gap, which is what the record means.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        # The default file name has one-second resolution and is opened with "wb": a resume
        # within the same second would overwrite the killed run's file. A nanosecond suffix
        # keeps names unique and in write order (TensorBoard reads files in name order).
        return SummaryWriter(
            str(self.logdir), purge_step=self.purge_step, filename_suffix=f".{time.time_ns():020d}"
        )

    def write(self, kind: str, record: dict) -> None:
        """Logs the record's scalars at its step (records without a step are not by step)."""
        if "step" not in record:
            return
        if self._writer is None:
            self._writer = self._open()
        step = int(record["step"])
        walltime = time.time()
        for tag, value in scalars(record).items():
            self._writer.add_scalar(f"{kind}/{tag}", value, step, walltime=walltime)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
