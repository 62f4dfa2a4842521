"""The multi-turn toy: a 2-layer decoder learns to find a secret number in [0, 15] within 6
turns, from "<" / ">" answers of the "guess" environment between its guesses.

    python launch.py --config=configs/guess.py --workdir=/tmp/prl_guess

Every prompt is the same ("0:15="), so a policy that ignores the answers finds the number
about a third of the time; one that halves the range finds it every time.
"""

from pipelinerl_jax import presets


def get_config():
    # The values, and why, live in the installed package: pipelinerl_jax.presets.guess().
    return presets.guess_config()
