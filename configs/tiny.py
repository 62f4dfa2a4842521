"""A seconds-scale smoke configuration: the default task on a 2-layer d=32 decoder.

    python launch.py --config=configs/tiny.py --workdir=/tmp/prl_tiny

Used by the test suite (resume, shutdown) and handy to check an installation end to end. It
does not learn much in its few steps; configs/default.py is the run that visibly learns.
"""

from pipelinerl_jax import presets


def get_config():
    # The values (and why they are what they are) live in the installed package, so a run
    # can be built from Python without this folder: pipelinerl_jax.presets.tiny().
    return presets.tiny_config()
