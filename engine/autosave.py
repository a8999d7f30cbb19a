"""Autosave: checkpoint a conversation periodically and on quit, without Qt or threads of its own.

The owner (app worker, CLI chat) calls `changed()` whenever the conversation changes, `tick()` at quiet points
(between replies, on a timer) and `flush()` on quit. Saving itself is the owner's `save(path)` callable (e.g.
`Session.save`), which writes atomically, so an autosave interrupted by a crash leaves the previous checkpoint.
The clock is injected so tests can move time by hand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from engine.errors import SparkError


class Autosaver:
    def __init__(
        self,
        path: Path,
        save: Callable[[Path], object],
        *,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._save = save
        self.interval_s = interval_s
        self._clock = clock
        self._dirty = False
        self._last_attempt = clock()
        self._lock = threading.Lock()  # tick() from the worker and flush() from quit never save twice at once
        self.saves = 0
        self.last_error: SparkError | None = None  # shown by the owner; a failed save stays dirty and is retried

    @property
    def dirty(self) -> bool:
        return self._dirty

    def changed(self) -> None:
        """The conversation changed since the last checkpoint."""
        self._dirty = True

    def tick(self) -> bool:
        """Save if there are changes and `interval_s` passed since the last attempt; True when it saved."""
        if not self._dirty or self._clock() - self._last_attempt < self.interval_s:
            return False
        return self._save_now()

    def flush(self) -> bool:
        """On quit: save now if anything changed; True when it saved (or there was nothing to save)."""
        return self._save_now() if self._dirty else True

    def _save_now(self) -> bool:
        with self._lock:
            self._last_attempt = self._clock()
            # Cleared before saving: a change made while the save runs marks it dirty again, so it is not lost.
            self._dirty = False
            try:
                self._save(self.path)
            except SparkError as exc:
                self._dirty = True
                self.last_error = exc
                return False
            self.saves += 1
            self.last_error = None
            return True
