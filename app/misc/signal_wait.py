"""Waiting for worker signals on the GUI thread (self-test and tests).

A plain function connected to a worker's signal runs on the worker's thread; a method of a QObject living on the
GUI thread runs on the GUI thread (queued). `GuiRelay` is such an object: it re-emits a worker signal from the
GUI thread, so whatever waits on it (an event loop, pytest-qt's waitSignal) is only touched by its own thread.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from PySide6.QtCore import QEventLoop, QObject, QTimer, Signal, SignalInstance


class GuiRelay(QObject):
    fired = Signal(object)  # the signal's only argument, the tuple of its arguments, or None for none

    def __init__(self, signal: SignalInstance, parent: QObject | None = None) -> None:
        super().__init__(parent)
        signal.connect(self.relay)

    def relay(self, *args: object) -> None:
        self.fired.emit(args[0] if len(args) == 1 else (args or None))


def wait_any(
    signals: dict[str, SignalInstance], timeout_ms: int, start: Callable[[], object] = lambda: None
) -> tuple[str, object]:
    """Call `start` (the request), then run an event loop until one of `signals` fires: its name and argument(s),
    or ("timeout", None). Listening begins before the request, so a worker that answers at once is not missed."""
    loop = QEventLoop()
    got: list[tuple[str, object]] = []
    relays = []
    for name, signal in signals.items():
        relay = GuiRelay(signal)
        relay.fired.connect(partial(_first, got, loop, name))
        relays.append(relay)
    start()
    QTimer.singleShot(timeout_ms, loop.quit)
    if not got:
        loop.exec()
    for relay in relays:
        relay.deleteLater()
    return got[0] if got else ("timeout", None)


def _first(got: list[tuple[str, object]], loop: QEventLoop, name: str, value: object) -> None:
    """Keep the first signal that fires, and end the wait."""
    if not got:
        got.append((name, value))
        loop.quit()
