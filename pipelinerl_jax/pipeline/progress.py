"""The console while a run trains: a tqdm bar over its steps on a terminal, plain lines elsewhere.

    progress = Progress(total=cfg.steps, initial=resumed_step)   # a bar only if stdout is a tty
    progress.echo("step 10 ...")       # printed above the bar (tqdm.write), or plainly
    progress.advance(step)             # the bar shows step + 1 of total
    progress.close()

Logs and pipes (CI, `tee`, nohup) get exactly the lines they got before: one per `log_every`.
"""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, *, initial: int = 0, stream=None, enabled: bool | None = None):
        self.stream = stream or sys.stdout
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=initial,
                unit="step",
                file=self.stream,
                dynamic_ncols=True,
                leave=True,
                desc="train",
            )

    def echo(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def advance(self, step: int) -> None:
        """Step `step` is trained: the bar shows step + 1 steps done."""
        if self.bar is not None and step + 1 > self.bar.n:
            self.bar.update(step + 1 - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
