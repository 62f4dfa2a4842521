"""A SIGINT whose KeyboardInterrupt is swallowed (raised inside a garbage-collector callback,
as jax's is) is delivered again until a handler has it; a handled one is not repeated."""

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import gc, os, signal, sys, time
    from pipelinerl_jax import interrupts

    interrupts.RETRY_S = 0.2
    interrupts.install()
    swallowed = []

    def callback(phase, info):  # what jax's _xla_gc_callback is to a KeyboardInterrupt
        if phase == "start" and not swallowed:
            swallowed.append(1)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs here, inside the callback
            except KeyboardInterrupt:
                pass  # CPython would print "Exception ignored" and drop it

    gc.callbacks.append(callback)
    try:
        gc.collect()
        gc.callbacks.remove(callback)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            time.sleep(0.01)
        print("not interrupted")
    except KeyboardInterrupt:
        interrupts.received()
        print("interrupted again after", len(swallowed), "swallowed")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:  # received: no further delivery
            time.sleep(0.01)
        print("no more")
    """
)


def test_a_swallowed_interrupt_is_delivered_again():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["interrupted again after 1 swallowed", "no more"]
