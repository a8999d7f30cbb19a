"""The menu-bar quick prompt: a tray item with "Quick Prompt…" opening a small floating panel.

The panel has its own ConversationClient (own worker thread, own short-lived session on the loaded engine), so
it never disturbs the main chat, even mid-reply: the engine's step lock interleaves the two token by token.
Esc closes the panel and frees its session; the next question starts a fresh one.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, QPoint, QRectF, Qt, Signal, Slot
from PySide6.QtGui import (
    QAction,
    QCloseEvent,
    QColor,
    QGuiApplication,
    QIcon,
    QKeyEvent,
    QPainter,
    QPainterPath,
    QPaintEvent,
    QPalette,
    QShowEvent,
)
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMenu,
    QPushButton,
    QSizePolicy,
    QSystemTrayIcon,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.misc.coalescer import TextCoalescer
from app.worker.client import ConversationClient
from app.worker.types import TurnResult
from engine import GenerationSettings

PANEL_WIDTH = 520
QUICK_MAX_TOKENS = 256  # a quick answer; the main window is for long replies


class QuickPromptPanel(QWidget):
    def __init__(self, client: ConversationClient, settings: Callable[[], GenerationSettings]) -> None:
        super().__init__(
            None, Qt.WindowType.Tool | Qt.WindowType.FramelessWindowHint | Qt.WindowType.WindowStaysOnTopHint
        )
        self.setObjectName("quickPrompt")
        self.setWindowTitle("Quick Prompt")
        self.setAttribute(Qt.WidgetAttribute.WA_TranslucentBackground)
        self._client = client
        self._settings = settings
        self._coalescer = TextCoalescer(parent=self)

        self.question = QLineEdit()
        self.question.setObjectName("quickQuestion")
        self.question.setPlaceholderText("Ask Spark anything…")
        self.question.setClearButtonEnabled(True)
        self.answer = QTextBrowser()
        self.answer.setObjectName("quickAnswer")
        self.answer.setPlaceholderText("The answer appears here.")
        self.answer.setFrameShape(QTextBrowser.Shape.NoFrame)
        self.answer.setMinimumHeight(160)
        self.hint = QLabel("Return to ask · Esc to close")
        self.hint.setObjectName("quickHint")
        self.copy_button = QPushButton("Copy")
        self.copy_button.setEnabled(False)

        # The hint takes the free width, so a longer hint never waits for a re-layout to show in full.
        self.hint.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        footer = QHBoxLayout()
        footer.addWidget(self.hint, 1)
        footer.addWidget(self.copy_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(18, 16, 18, 14)
        layout.setSpacing(10)
        layout.addWidget(self.question)
        layout.addWidget(self.answer, 1)
        layout.addLayout(footer)
        self.resize(PANEL_WIDTH, 300)

        self.question.returnPressed.connect(self._on_ask)
        self.copy_button.clicked.connect(self._on_copy)
        self._coalescer.flushed.connect(self._on_text)
        client.delta.connect(self._coalescer.push)
        client.finished.connect(self._on_finished)
        client.error.connect(self._on_error)

    def open_centered(self) -> None:
        screen = QGuiApplication.primaryScreen().availableGeometry()
        # Where Spotlight sits: centred, a little above the middle.
        self.move(screen.center() - QPoint(self.width() // 2, screen.height() // 4))
        self.show()
        self.raise_()
        self.activateWindow()
        self.question.setFocus()

    def answer_text(self) -> str:
        return self.answer.toPlainText()

    # -- events ----------------------------------------------------------------------------------------------------
    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() == Qt.Key.Key_Escape:
            self.close()
            return
        super().keyPressEvent(event)

    def showEvent(self, event: QShowEvent) -> None:
        self.question.selectAll()
        super().showEvent(event)

    def closeEvent(self, event: QCloseEvent) -> None:
        self._client.release()
        self._coalescer.discard()
        super().closeEvent(event)

    def paintEvent(self, event: QPaintEvent) -> None:
        # A rounded HUD-like card; the window itself is translucent so the corners stay clear.
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        path = QPainterPath()
        path.addRoundedRect(QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5), 14, 14)
        p.fillPath(path, self.palette().color(QPalette.ColorRole.Window))
        border = QColor(self.palette().color(QPalette.ColorRole.WindowText))
        border.setAlphaF(0.18)
        p.setPen(border)
        p.drawPath(path)

    # -- slots -----------------------------------------------------------------------------------------------------
    @Slot()
    def _on_ask(self) -> None:
        text = self.question.text().strip()
        if not text or self._client.busy:
            return
        # Each question is its own short conversation: the previous one is dropped.
        self._client.release()
        self.answer.clear()
        self.copy_button.setEnabled(False)
        self.hint.setText("Answering…  Esc to close")
        settings = self._settings()
        settings.max_tokens = min(settings.max_tokens, QUICK_MAX_TOKENS)
        self._client.send(text, settings)

    @Slot(str)
    def _on_text(self, text: str) -> None:
        cursor = self.answer.textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        cursor.insertText(text)
        self.answer.setTextCursor(cursor)

    @Slot(TurnResult)
    def _on_finished(self, result: TurnResult) -> None:
        self._coalescer.flush()
        self.copy_button.setEnabled(bool(self.answer_text()))
        self.hint.setText("Return to ask · Esc to close")

    @Slot(str)
    def _on_error(self, message: str) -> None:
        self.answer.setPlainText(message)

    @Slot()
    def _on_copy(self) -> None:
        QGuiApplication.clipboard().setText(self.answer_text())
        self.hint.setText("Copied · Esc to close")


class QuickPromptTray(QSystemTrayIcon):
    """The status-bar item (only where the platform has a system tray)."""

    quick_prompt_requested = Signal()
    show_window_requested = Signal()
    quit_requested = Signal()

    def __init__(self, icon: QIcon, parent: QObject | None = None) -> None:
        super().__init__(icon, parent)
        self.setToolTip("MLoT Spark")
        self._menu = QMenu()
        for text, signal in (
            ("Quick Prompt…", self.quick_prompt_requested),
            ("Show MLoT Spark", self.show_window_requested),
            ("Quit MLoT Spark", self.quit_requested),
        ):
            action = QAction(text, self._menu)
            action.triggered.connect(signal)
            self._menu.addAction(action)
            if text.startswith("Show"):
                self._menu.addSeparator()
        self.setContextMenu(self._menu)
