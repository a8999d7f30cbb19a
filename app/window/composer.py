"""The composer: the prompt box (Return sends, Shift+Return a new line) that grows with its text up to a third of
the window, the Send/Stop button, and a live count of the prompt's tokens against the model's context."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt, QTimer, Signal, Slot
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

COUNT_DELAY_MS = 150  # the count follows typing after this pause (a 20,000-character paste counts once)
MIN_LINES = 3


class PromptEdit(QPlainTextEdit):
    """Return sends, Shift+Return starts a new line (as in Messages). The window decides whether a send is taken
    now (it says why not, e.g. while a reply is being written); the text stays until it is."""

    submitted = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("promptEdit")
        self.setPlaceholderText("Message Spark…  (Return to send, Shift+Return for a new line)")
        self.setTabChangesFocus(True)
        self.max_height = 10_000  # the window sets a third of its height
        self.document().documentLayout().documentSizeChanged.connect(lambda _s: self.fit())
        self.fit()

    def fit(self) -> None:
        """As tall as the text (at least MIN_LINES lines, at most max_height); beyond that it scrolls."""
        line = self.fontMetrics().lineSpacing()
        margins = int(2 * self.document().documentMargin()) + 10
        lines = max(MIN_LINES, int(self.document().size().height()))  # a plain document's height is in lines
        self.setFixedHeight(max(line * MIN_LINES + margins, min(self.max_height, lines * line + margins)))

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
                return
            text = self.toPlainText().strip()
            if text:
                self.submitted.emit(text)
            return
        super().keyPressEvent(event)


class Composer(QWidget):
    """The prompt box, the Send button and the token count under them."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("composer")
        self.prompt = PromptEdit()
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.setDefault(True)
        self.send_button.setMinimumWidth(84)
        self.count = QLabel("")
        self.count.setObjectName("tokenCount")
        self.count.setAlignment(Qt.AlignmentFlag.AlignRight)
        # Says in the chat itself that this conversation's replies are JSON (Chat ▸ Reply as JSON); a click ends it.
        self.json_chip = QPushButton("{ }  Replies are JSON  ✕")
        self.json_chip.setObjectName("modeChip")
        self.json_chip.setToolTip("Replies in this conversation follow its JSON schema. Click to turn this off.")
        self.json_chip.setAccessibleName("Replies are JSON in this conversation; turn off")
        self.json_chip.setCursor(Qt.CursorShape.PointingHandCursor)
        self.json_chip.hide()
        row = QHBoxLayout()
        row.setSpacing(10)
        row.addWidget(self.prompt, 1)
        row.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 10, 16, 8)
        layout.setSpacing(4)
        layout.addLayout(row)
        below = QHBoxLayout()
        below.addWidget(self.json_chip, 0, Qt.AlignmentFlag.AlignLeft)
        below.addWidget(self.count, 1)
        layout.addLayout(below)
        self._counter: Callable[[str], int] | None = None
        self._context = 0
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(COUNT_DELAY_MS)
        self._timer.timeout.connect(self._update_count)
        self.prompt.textChanged.connect(self._timer.start)

    def set_counter(self, counter: Callable[[str], int] | None, context_tokens: int) -> None:
        """How the loaded model counts tokens, and its context; None (a remote model): no count is shown."""
        self._counter, self._context = counter, context_tokens
        self._update_count()

    def set_max_height(self, height: int) -> None:
        self.prompt.max_height = height
        self.prompt.fit()

    @Slot()
    def _update_count(self) -> None:
        text = self.prompt.toPlainText()
        if self._counter is None or not text.strip():
            self.count.setText("")
            return
        n = self._counter(text)
        over = self._context and n > self._context
        self.count.setProperty("over", bool(over))
        self.count.style().unpolish(self.count)
        self.count.style().polish(self.count)
        tail = f" of the model's {self._context:,}-token context" if self._context else ""
        self.count.setText(f"{n:,} tokens{tail}" + (" — only its end fits at once" if over else ""))

    def token_count_text(self) -> str:
        return self.count.text()
