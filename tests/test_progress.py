"""The console's progress bar: on a terminal a tqdm bar over the steps with the step lines
above it; anywhere else exactly the plain lines."""

import io

from pipelinerl_jax.pipeline.metrics import MetricsWriter
from pipelinerl_jax.pipeline.progress import Progress


class FakeTty(io.StringIO):
    def isatty(self):
        return True


def test_bar_on_a_terminal_counts_steps_and_keeps_lines():
    out = FakeTty()
    progress = Progress(10, initial=2, stream=out)
    writer = MetricsWriter(None, echo_every=2, echo=progress.echo, on_train=progress.advance)
    for step in range(2, 6):
        writer.write("train", {"step": step, "reward/mean": 0.5})
    assert progress.bar.n == 6  # steps 0-5 done (resumed at 2)
    progress.close()
    text = out.getvalue()
    assert "6/10" in text and "step" in text
    lines = [l for l in text.replace("\r", "\n").splitlines() if l.startswith("step ")]
    assert [int(l.split()[1]) for l in lines] == [2, 4]  # log_every lines above the bar


def test_no_bar_in_a_pipe():
    out = io.StringIO()  # isatty() is False: logs, CI, tee
    progress = Progress(10, stream=out)
    assert progress.bar is None
    progress.echo("step     0  reward 0.1")
    progress.advance(0)
    progress.close()
    assert out.getvalue() == "step     0  reward 0.1\n"
