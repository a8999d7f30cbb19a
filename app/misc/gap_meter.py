"""Measures how responsive the GUI thread is: the longest gap between ticks of a 10 ms timer.

A blocked event loop shows up as a long gap; used by `--self-test` and the tests.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, Qt, QTimer, Slot

TICK_MS = 10


class GapMeter(QObject):
    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._timer = QTimer(self)
        self._timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._timer.setInterval(TICK_MS)
        self._timer.timeout.connect(self._on_tick)
        self._last = 0.0
        self.longest_s = 0.0
        self.ticks = 0

    def start(self) -> None:
        self.longest_s, self.ticks = 0.0, 0
        self._last = time.perf_counter()
        self._timer.start()

    def stop(self) -> float:
        self._on_tick()
        self._timer.stop()
        return self.longest_s

    @Slot()
    def _on_tick(self) -> None:
        now = time.perf_counter()
        self.longest_s = max(self.longest_s, now - self._last)
        self._last = now
        self.ticks += 1
