"""Launch a PipelineRL run: absl flags -> config -> pipeline.run.

    python launch.py                                     # the embedded default (configs/default.py)
    python launch.py --config=configs/default.py --workdir=/tmp/run --config.trainer.learning_rate=1e-3

Bad configuration exits with code 2 and a one-line message before anything compiles.
"""

import logging
import os
import signal
import sys

from absl import app, flags
from ml_collections import config_flags

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT, "Python config file (get_config()).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (metrics.jsonl, config.json).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # Ctrl-C / SIGINT must stop the run even when the parent ignored or blocked SIGINT (signal
    # dispositions and masks are inherited through fork + exec, e.g. from test runners and
    # job wrappers). Done before JAX starts its threads, which inherit this thread's mask.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from pipelinerl_jax import config as config_lib
    from pipelinerl_jax.errors import ConfigError
    from pipelinerl_jax.pipeline.run import run
    try:
        cfg = config_lib.from_config_dict(_CONFIG.value)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    from pipelinerl_jax.pipeline.coordinator import PipelineError
    try:
        run(cfg, _WORKDIR.value)
    except KeyboardInterrupt:
        print("interrupted: sampler and trainer stopped, reward workers closed", file=sys.stderr)
        _exit_now(130)
    except PipelineError as e:  # a thread failed; its traceback is in the message
        print(f"run failed: {e}", file=sys.stderr)
        _exit_now(1)
    except ConfigError as e:  # found once the devices/model are known (e.g. mesh too large)
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)


def _exit_now(code: int) -> None:
    """Exits without interpreter finalization, right after the run's threads stopped.

    Why: a thread that has just finished still runs jaxlib's C++ thread-local destructors,
    which take the GIL; racing them against finalization aborted the process (SIGABRT,
    "FATAL: exception not rethrown") in about half of the Ctrl-C exits. Nothing is lost:
    run() has already closed the checkpointer (waiting for its writes) and the reward workers,
    and metrics.jsonl is written line by line.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    app.run(main)
