"""Session files as the worker meets them: a quick look at one (its transcript and kind, no memory touched), and
the one sentence each failure to read or write one becomes (the open conversation stays as it was)."""

from __future__ import annotations

import logging
from pathlib import Path

from engine import SessionData, SparkError, load_session

log = logging.getLogger(__name__)


def peek(path: Path) -> SessionData | None:
    """The file's transcript and kind, or None for one that does not read (opening it says what is wrong)."""
    try:
        return load_session(path)
    except Exception:
        return None


def read_error(path: Path, exc: Exception) -> str:
    if isinstance(exc, SparkError):
        return str(exc)
    if isinstance(exc, OSError):
        return f"The session {path.name} could not be read ({exc.strerror or exc})."
    log.error("restore failed", exc_info=exc)
    return f"The session {path.name} could not be restored ({type(exc).__name__}: {exc})."


def save_error(path: Path, exc: Exception) -> str:
    if isinstance(exc, SparkError):
        return str(exc)
    if isinstance(exc, OSError):
        return f"The session could not be saved to {path} ({exc.strerror or exc})."
    log.error("save failed", exc_info=exc)
    return f"The session could not be saved ({type(exc).__name__}: {exc})."
