"""The status bar's items: the model and where it runs, a load's seconds with Cancel, a reply's speed, and the Local
Server's address. They own their text and the loading clock; the presenters say what to show."""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import QLabel, QProgressBar, QPushButton, QStatusBar


class StatusItems(QObject):
    cancel_requested = Signal()  # the load's Cancel
    copy_requested = Signal()  # the server address's "Copy" link

    def __init__(
        self, bar: QStatusBar, parent: QObject | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(parent)
        self._clock = clock
        self._model = QLabel("No model")
        self._speed = QLabel()
        self._progress = QProgressBar()
        self._progress.setRange(0, 0)  # indeterminate: loading reports no fraction
        self._progress.setMaximumWidth(140)
        self._cancel = QPushButton("Cancel")
        self._cancel.setFlat(True)
        self._cancel.clicked.connect(self.cancel_requested)
        bar.addWidget(self._model, 1)
        bar.addPermanentWidget(self._speed)
        bar.addPermanentWidget(self._progress)
        bar.addPermanentWidget(self._cancel)
        self._progress.hide()
        self._cancel.hide()
        self._loading_text = ""
        self._loading_since = 0.0
        self._timer = QTimer(self)
        self._timer.setInterval(1000)
        self._timer.timeout.connect(self._tick)
        self._server = QLabel()
        self._server.setObjectName("serverStatus")
        self._server.setTextFormat(Qt.TextFormat.RichText)
        self._server.linkActivated.connect(lambda _href: self.copy_requested.emit())
        bar.addPermanentWidget(self._server)
        self._server.hide()

    def show_loading(self, text: str) -> None:
        """`text` with the seconds since it began, counting, and Cancel beside it."""
        self._loading_text = text
        self._loading_since = self._clock()
        self._model.setText(text)
        self._progress.show()
        self._cancel.show()
        self._timer.start()

    @Slot()
    def _tick(self) -> None:
        seconds = int(self._clock() - self._loading_since)
        self._model.setText(f"{self._loading_text} ({seconds} s)")

    def end_loading(self) -> None:
        self._timer.stop()
        self._progress.hide()
        self._cancel.hide()

    def show_model(self, text: str, details: str | None = None) -> None:
        """The model's words; `details` (where it is, how it runs), when given, on hover."""
        self._model.setText(text)
        if details is not None:
            self._model.setToolTip(details)

    def show_speed(self, text: str) -> None:
        self._speed.setText(text)

    def show_server(self, running: bool, url: str) -> None:
        """While the server is on: where, with a link that asks to copy the address."""
        link = self._server.palette().color(self._server.palette().ColorRole.Link).name()
        self._server.setText(f'Serving on {url} · <a style="color:{link}; text-decoration:none" href="copy">Copy</a>')
        self._server.setVisible(running)
