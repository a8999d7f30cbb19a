"""The QApplication: Finder/Dock file opens and the crash handler.

macOS delivers "open this .spark file" (double-click in Finder, drop on the Dock icon) as a QEvent.FileOpen to
the application object, possibly before the main window exists; such files wait in `pending_files` until the
window takes them.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from PySide6.QtCore import QEvent, QObject, Signal, Slot
from PySide6.QtGui import QFileOpenEvent
from PySide6.QtWidgets import QApplication, QMessageBox

from app.misc import theme
from app.misc.icons import app_icon
from app.misc.standarddirs import init_application_names

log = logging.getLogger(__name__)


class SparkApplication(QApplication):
    file_open_requested = Signal(Path)

    def __init__(self, argv: list[str]) -> None:
        init_application_names()
        super().__init__(argv)
        self.setWindowIcon(app_icon())
        self.scheme = theme.apply(self)
        # Follows the system's light/dark choice as it changes (unless a scheme was chosen with set_scheme).
        self._fixed_scheme = False
        self.styleHints().colorSchemeChanged.connect(self._on_scheme_changed)
        self.pending_files: list[Path] = []
        self._receiver_connected = False

    def set_scheme(self, scheme: theme.Scheme) -> None:
        """Use `scheme` whatever the system's (the screenshots show both)."""
        self._fixed_scheme = True
        self.scheme = theme.apply(self, scheme)

    def set_appearance(self, choice: str) -> None:
        """View ▸ Appearance: "light" or "dark" whatever the system's, or "system" to follow it again."""
        if choice in ("light", "dark"):
            self.set_scheme(theme.Scheme(choice))
        else:
            self._fixed_scheme = False
            self.scheme = theme.apply(self)

    @Slot()
    def _on_scheme_changed(self) -> None:
        if not self._fixed_scheme:
            self.scheme = theme.apply(self)

    def connect_file_opens(self, slot: Callable[[Path], None]) -> None:
        """Route FileOpen events to `slot`, first delivering those that arrived before anyone listened."""
        self.file_open_requested.connect(slot)
        self._receiver_connected = True
        pending, self.pending_files = self.pending_files, []
        for path in pending:
            self.file_open_requested.emit(path)

    def event(self, e: QEvent) -> bool:
        if e.type() == QEvent.Type.FileOpen and isinstance(e, QFileOpenEvent):
            path = Path(e.file())
            if self._receiver_connected:
                self.file_open_requested.emit(path)
            else:
                self.pending_files.append(path)
            return True
        return super().event(e)


class CrashReporter(QObject):
    """sys.excepthook / threading.excepthook: log the traceback to the data dir and show a dialog.

    Hooks may run on any thread; the dialog is shown on the GUI thread through a queued signal.
    """

    crashed = Signal(str, str)  # summary, log path

    def __init__(self, log_path: Path) -> None:
        super().__init__()
        self.log_path = log_path
        self.crashed.connect(self._on_crashed)

    def install(self) -> None:
        sys.excepthook = self._hook
        threading.excepthook = self._thread_hook

    def _thread_hook(self, args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:  # the hook's arguments allow None: then there is nothing to report
            self._hook(args.exc_type, args.exc_value, args.exc_traceback)

    def _hook(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a", encoding="utf-8") as f:
                f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n{text}\n")
        except OSError:
            log.error("could not write the crash log %s", self.log_path)
        if sys.__stderr__ is not None:  # None under a GUI launcher without a console
            sys.__stderr__.write(text)
        self.crashed.emit(f"{exc_type.__name__}: {exc}", str(self.log_path))

    @Slot(str, str)
    def _on_crashed(self, summary: str, log_path: str) -> None:
        box = QMessageBox(
            QMessageBox.Icon.Critical, "MLoT Spark ran into a problem", "Something went wrong inside MLoT Spark."
        )
        box.setInformativeText(
            f"{summary}\n\nYour conversation is still open; saving it now is a good idea. Details were written to {log_path}."
        )
        box.exec()
