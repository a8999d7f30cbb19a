"""User-facing errors: each carries one sentence saying what is wrong and what to do.

Anything raised as a `SparkError` is shown to the user as-is (CLI: one line on stderr; app: a message),
so the message must be a complete sentence without a traceback's context.
"""

from __future__ import annotations


class SparkError(Exception):
    """A problem the user can act on; `str(err)` is one clear sentence."""


class ModelLoadError(SparkError):
    """The model folder is missing, incomplete, corrupt, unsafe (pickle) or of an unknown architecture."""


class TokenizerError(SparkError):
    """The tokenizer files are missing or unreadable."""


class BackendUnavailable(SparkError):
    """A requested compute backend cannot run on this machine."""


class SessionFileError(SparkError):
    """A `.spark` session file cannot be read or applied."""


class InputTooLarge(SparkError):
    """A prompt or file is larger than the engine accepts."""


class InsufficientMemory(SparkError):
    """A model (weights plus KV cache) does not fit in the memory this machine can give it."""
