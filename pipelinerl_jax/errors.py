"""User-facing error types shared by the whole project.

`ConfigError` carries a one-line message that names the offending file, flag, tensor or value
and says how to fix it. Entry points catch it and exit with code 2 instead of a traceback.
`did_you_mean` gives such a message its suggestion for a misspelt name.
"""

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """Bad user input (configuration, checkpoint, tokenizer): a one-line, actionable message."""


def did_you_mean(name, choices: Iterable[str]) -> str:
    """ "; did you mean X?" for the closest of `choices` to `name`, or ""."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""
