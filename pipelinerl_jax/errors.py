"""User-facing error types shared by the whole project.

`ConfigError` carries a one-line message that names the offending file, flag, tensor or value
and says how to fix it. Entry points catch it and exit with code 2 instead of a traceback.
"""


class ConfigError(ValueError):
    """Bad user input (configuration, checkpoint, tokenizer): a one-line, actionable message."""
