"""The typed errors library code raises; entry points turn each into one `error: ...` line and an exit code.

They derive from ValueError too, so code written against the older plain ValueErrors keeps working.
"""
from __future__ import annotations


class PocketLMError(Exception):
    """Base of every error that is the user's to fix (bad flag, bad file): printed as one line, no traceback."""


class ConfigError(PocketLMError, ValueError):
    """A flag, config file or model configuration that cannot work; the message names it and what was expected."""


class DataError(PocketLMError, ValueError):
    """Bad input data; the message starts with `file:line:` when a line is at fault."""


class CheckpointError(PocketLMError, ValueError):
    """A checkpoint or run directory that cannot be loaded or resumed; the message names the file."""


class TokenizerError(PocketLMError, ValueError):
    """A tokenizer directory that cannot be used; the message names the file."""


class TrainingError(PocketLMError, RuntimeError):
    """Training cannot go on (out of memory, diverged); the message says what to change."""
