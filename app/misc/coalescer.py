"""Coalesces streamed text deltas so the chat view repaints at most once per frame.

A fast model emits hundreds of tokens per second; repainting a QTextEdit for each would starve the event loop.
Deltas are buffered and released by a single-shot timer at most every `interval_ms` (one 60 Hz frame).
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QTimer, Signal, Slot

FRAME_MS = 16


class TextCoalescer(QObject):
    flushed = Signal(str)  # the text gathered since the previous flush (never empty)

    def __init__(self, interval_ms: int = FRAME_MS, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._buffer: list[str] = []
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self.flush)

    @Slot(str)
    def push(self, text: str) -> None:
        if not text:
            return
        self._buffer.append(text)
        if not self._timer.isActive():
            self._timer.start()

    @Slot()
    def flush(self) -> None:
        """Emit whatever is buffered now (also called before a turn's end is shown, so no text arrives late)."""
        self._timer.stop()
        if self._buffer:
            text = "".join(self._buffer)
            self._buffer.clear()
            self.flushed.emit(text)

    def discard(self) -> None:
        self._timer.stop()
        self._buffer.clear()
