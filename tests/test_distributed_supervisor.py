"""The supervisor ends a job promptly and completely, and says in one line who failed and how;
ProcessSpec refuses bad launch settings in one line; jax.distributed peers started with
`runtime.initialize` exchange data, and losing any of them (the coordinator's host included)
ends the job within the supervisor's bound, with no process left behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from pipelinerl_jax.distributed import runtime
from pipelinerl_jax.distributed.supervisor import Child, supervise
from pipelinerl_jax.errors import ConfigError

PY = sys.executable
GRACE = 2.0


def _child(name, code):
    return Child(name, (PY, "-c", textwrap.dedent(code)))


SLEEPER = """
import os, time
print("pid", os.getpid(), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent has not reaped it yet).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _all_gone(pids, within_s: float = 5.0) -> bool:
    """Whether every pid is gone within `within_s`: a SIGKILLed grandchild is reaped by init
    after the supervisor returns, asynchronously, so a loaded machine can take a moment."""
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _pids(lines):
    return [int(line.split()[-1]) for line in lines if " pid " in line]


def _run(children, **kw):
    lines = []
    t0 = time.monotonic()
    outcome = supervise(children, grace_s=GRACE, echo=lines.append, **kw)
    return outcome, lines, time.monotonic() - t0


def test_all_succeed_output_prefixed():
    outcome, lines, _ = _run([_child("a", "print('hello')"), _child("b", "print('world')")])
    assert outcome.returncode == 0 and outcome.line is None
    assert "[a] hello" in lines and "[b] world" in lines


def test_an_exception_ends_the_job_in_one_line_and_no_process_is_left():
    failing = _child(
        "process 1 (sampler 0)", "import time; time.sleep(1); raise ValueError('boom')"
    )
    # A child whose own child (a grandchild) would outlive it without the process-group kill.
    parent = _child(
        "process 0 (trainer)",
        """
        import os, subprocess, sys, time
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print("pid", os.getpid(), flush=True)
        print("grandchild pid", g.pid, flush=True)
        time.sleep(120)
        """,
    )
    outcome, lines, wall = _run([parent, failing, _child("process 2 (sampler 1)", SLEEPER)])
    assert outcome.returncode == 1
    assert outcome.line == (
        "process 1 (sampler 0) exited with code 1: ValueError: boom; "
        "stopped the other 2 process(es)"
    )
    assert lines[-1] == outcome.line
    assert wall < 4 + GRACE + 10 and outcome.seconds_to_stop < GRACE + 2
    pids = _pids(lines)
    assert len(pids) == 3
    assert _all_gone(pids)


def test_kill_9_of_a_child_is_named():
    victim = _child(
        "process 1 (sampler 0)", "import os, time; time.sleep(1); os.kill(os.getpid(), 9)"
    )
    outcome, lines, _ = _run([_child("process 0 (trainer)", SLEEPER), victim])
    assert outcome.returncode == 1
    assert outcome.line.startswith("process 1 (sampler 0) was killed by SIGKILL")
    assert _all_gone(_pids(lines))


def test_elastic_a_spare_child_s_death_ends_nobody_and_the_job_ends_with_the_trainer():
    trainer = _child("process 0 (trainer)", "import time; time.sleep(3)")
    victim = Child(
        "process 1 (sampler 0)",
        (PY, "-c", "import os, time; time.sleep(0.5); os.kill(os.getpid(), 9)"),
        spare=True,
    )
    sleeper = Child("process 2 (sampler 1)", (PY, "-c", SLEEPER), spare=True)
    outcome, lines, seconds = _run([trainer, victim, sleeper])
    assert outcome.returncode == 0, lines
    said = [line for line in lines if "go on without it" in line]
    assert said == [
        "process 1 (sampler 0) was killed by SIGKILL; the others go on without it (elastic)"
    ]
    assert _all_gone(_pids(lines))  # the sampler still running was ended with the job
    assert seconds < 3 + 4 * GRACE


def test_elastic_the_trainer_s_death_still_ends_the_job_in_one_line():
    trainer = _child(
        "process 0 (trainer)", "import os, time; time.sleep(1); os.kill(os.getpid(), 9)"
    )
    samplers = [
        Child(f"process {i} (sampler {i - 1})", (PY, "-c", SLEEPER), spare=True) for i in (1, 2)
    ]
    outcome, lines, _ = _run([trainer, *samplers])
    assert outcome.returncode == 1
    assert (
        outcome.line == "process 0 (trainer) was killed by SIGKILL; stopped the other 2 process(es)"
    )
    assert _all_gone(_pids(lines))


def _supervisor_with_two_sleepers():
    """Starts a supervisor of two sleepers in its own process; returns it and the sleepers'
    pids once both have printed them, or (None, everything it printed) if it ended first."""
    script = textwrap.dedent(
        f"""
        import sys
        from pipelinerl_jax.distributed.supervisor import Child, supervise
        sleeper = Child("s", (sys.executable, "-c", {SLEEPER!r}))
        outcome = supervise([sleeper, sleeper], echo=lambda line: print(line, flush=True))
        sys.exit(f"supervise returned {{outcome}}")
        """
    )
    sup = subprocess.Popen(
        [PY, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, pids = [], []
    while len(pids) < 2:
        line = sup.stdout.readline()
        if not line:
            sup.wait(timeout=10)
            return None, f"exit status {sup.returncode}, output:\n" + "".join(lines)
        lines.append(line)
        pids += _pids([line])
    return sup, pids


def test_kill_9_of_the_supervisor_takes_its_children():
    # One CI run (2 cores, the whole suite beside it) saw the supervisor end before both
    # sleepers printed, with nothing captured; a second try says whether that recurs, and a
    # failure now carries everything the supervisor and its children printed.
    sup, pids = _supervisor_with_two_sleepers()
    if sup is None:
        first = pids
        sup, pids = _supervisor_with_two_sleepers()
        assert sup is not None, f"the supervisor ended early twice:\n{first}\n---\n{pids}"
        warnings.warn(f"the supervisor ended early once, then ran: {first}", stacklevel=1)
    try:
        sup.send_signal(signal.SIGKILL)
        sup.wait(timeout=10)
        assert _all_gone(pids)
    finally:
        sup.kill()


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(coordinator="localhost"), "expected host:port"),
        (dict(num_processes=1), "at least 2"),
        (dict(process_id=3), r"outside 0\.\.2"),
        (dict(trainer_processes=3), "at least one of the 3 processes samples"),
    ],
)
def test_process_spec_refuses_bad_settings(kw, match):
    args = {**dict(coordinator="127.0.0.1:1234", num_processes=3, process_id=0), **kw}
    with pytest.raises(ConfigError, match=match):
        runtime.ProcessSpec(**args)


def test_process_spec_roles():
    specs = [runtime.ProcessSpec("127.0.0.1:1234", 3, i) for i in range(3)]
    assert [s.role for s in specs] == ["trainer", "sampler", "sampler"]
    assert [s.name for s in specs] == [
        "process 0 (trainer)",
        "process 1 (sampler 0)",
        "process 2 (sampler 1)",
    ]


PEER = """
import os, sys, time
import numpy as np
from jax.experimental import multihost_utils
from pipelinerl_jax.distributed import runtime
spec = runtime.ProcessSpec(sys.argv[1], 3, int(sys.argv[2]))
runtime.initialize(spec, heartbeat_s=5)
got = multihost_utils.process_allgather(np.int32(10 + spec.process_id))
print("pid", os.getpid(), flush=True)
print("gathered", sorted(int(g) for g in np.ravel(got)), flush=True)
if spec.process_id == int(sys.argv[3]):
    time.sleep(1)
    os.kill(os.getpid(), 9)
time.sleep(120)
"""


@pytest.mark.parametrize("victim", [2, 0])  # a sampler; the coordinator's process
def test_jax_distributed_peers_and_a_lost_one(victim):
    coordinator = f"127.0.0.1:{runtime.free_port()}"
    env = (("JAX_PLATFORMS", "cpu"),)
    children = [
        Child(
            runtime.ProcessSpec(coordinator, 3, i).name,
            (PY, "-c", PEER, coordinator, str(i), str(victim)),
            env,
        )
        for i in range(3)
    ]
    outcome, lines, wall = _run(children)
    assert sum("gathered [10, 11, 12]" in line for line in lines) == 3, lines[-20:]
    name = children[victim].name
    assert outcome.line.startswith(f"{name} was killed by SIGKILL"), outcome.line
    assert outcome.seconds_to_stop < GRACE + 2 and wall < 60
    assert _all_gone(_pids(lines))


def test_lines_of_children_printing_at_once_never_run_together():
    """Each child has a reader thread; an echo that writes a line and its newline in two
    writes (as print does) must still get whole lines, one child's at a time."""
    chatty = 'for i in range(300): print("line", i, flush=True)'
    written = []

    def two_writes(line):
        written.append(line)
        time.sleep(0)  # let another reader in between the line and its newline
        written.append("\n")

    outcome = supervise([_child("a", chatty), _child("b", chatty)], echo=two_writes)
    assert outcome.returncode == 0
    lines = "".join(written).splitlines()
    assert sum(line.startswith(("[a] line", "[b] line")) for line in lines) == 600
    assert all(line.count("] line") == 1 for line in lines if "line" in line), lines
