"""The composer: a rounded box holding the prompt (Return sends, Shift+Return a new line; it grows with its text up
to a third of the window) and a round icon button that sends, or stops a reply being written; under it the JSON
mode's chip and a live count of the prompt's tokens against the model's context. Documents come in by the paperclip,
by dropping files on the prompt, or by pasting a file (or one file's path) into it; their chips sit above the box
(app.window.attachments)."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QEvent, QMimeData, QObject, QSize, Qt, QTimer, Signal, Slot
from PySide6.QtGui import QImage, QKeyEvent, QPalette
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.misc import theme
from app.misc.ui_icons import icon
from app.window.attachments import AttachmentsBar, dropped_documents, pasted_path
from app.window.pictures import image_png

COUNT_DELAY_MS = 150  # the count follows typing after this pause (a 20,000-character paste counts once)
MIN_LINES = 2
SEND_WORDS = {  # the button's state (its text, as the window sets it) -> icon, tooltip
    "Send": ("send", "Send (Return)"),
    "Stop": ("stop", "Stop the reply"),
    "Stopping…": ("stop", "Stopping…"),
}


class SendButton(QPushButton):
    """Send, or Stop while a reply is written: an icon in a round button. The window sets its state as text
    ("Send", "Stop", "Stopping…"); the text is its accessible name and tooltip, the icon is what is drawn."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._state = ""
        self.setIconSize(QSize(18, 18))
        self.setCursor(Qt.CursorShape.PointingHandCursor)
        self.setText("Send")

    def setText(self, text: str) -> None:
        self._state = text
        name, tip = SEND_WORDS.get(text, ("send", text))
        self.setIcon(icon(name, QPalette.ColorRole.HighlightedText))
        self.setToolTip(tip)
        self.setAccessibleName(text)
        super().setText("")

    def text(self) -> str:
        return self._state


class PromptEdit(QPlainTextEdit):
    """Return sends, Shift+Return starts a new line (as in Messages). The window decides whether a send is taken
    now (it says why not, e.g. while a reply is being written); the text stays until it is."""

    submitted = Signal(str)
    files_given = Signal(list)  # list[Path]: documents dropped or pasted here (attached, not typed)
    image_pasted = Signal(bytes)  # clipboard image data (a copied screenshot), as PNG

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("promptEdit")
        self.setPlaceholderText("Message Spark…")
        self.setAccessibleName("Message")
        self.setToolTip("Return sends; Shift+Return starts a new line")
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setTabChangesFocus(True)
        self.max_height = 10_000  # the window sets a third of its height
        self.sends_empty: Callable[[], bool] = lambda: False  # pictures waiting: Return sends them without text
        self.document().documentLayout().documentSizeChanged.connect(lambda _s: self.fit())
        self.fit()

    def fit(self) -> None:
        """As tall as the text (at least MIN_LINES lines, at most max_height); beyond that it scrolls."""
        line = self.fontMetrics().lineSpacing()
        margins = int(2 * self.document().documentMargin()) + 10
        lines = max(MIN_LINES, int(self.document().size().height()))  # a plain document's height is in lines
        self.setFixedHeight(max(line * MIN_LINES + margins, min(self.max_height, lines * line + margins)))

    def canInsertFromMimeData(self, source: QMimeData) -> bool:
        return bool(dropped_documents(source)) or source.hasImage() or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:
        """A dropped or pasted file, or a pasted path of one, is attached rather than typed as its address; pasted
        image data (a screenshot copied) becomes a picture for the next message."""
        paths = dropped_documents(source)
        if not paths and source.hasImage() and not source.hasUrls():
            image = source.imageData()
            if isinstance(image, QImage) and not image.isNull():
                self.image_pasted.emit(image_png(image))
                return
        if not paths and source.hasText() and not source.hasUrls():
            one = pasted_path(source.text())
            paths = [one] if one is not None else []
        if paths:
            self.files_given.emit(paths)
            return
        super().insertFromMimeData(source)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
                return
            text = self.toPlainText().strip()
            if text or self.sends_empty():
                self.submitted.emit(text)
            return
        super().keyPressEvent(event)


class Composer(QWidget):
    """The rounded box (prompt and Send/Stop), the JSON chip and the token count under it."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("composer")
        self.prompt = PromptEdit()
        self.send_button = SendButton()
        self.send_button.setObjectName("sendButton")
        self.send_button.setDefault(True)
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
        self.attach_button = QToolButton()
        self.attach_button.setObjectName("attachButton")
        self.attach_button.setIcon(icon("paperclip"))
        self.attach_button.setIconSize(QSize(18, 18))
        self.attach_button.setAutoRaise(True)
        self.attach_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.attach_button.setToolTip(
            "Attach documents the model may draw on (text, Markdown, code, HTML, PDF), or pictures to ask about"
        )
        self.attach_button.setAccessibleName("Attach Documents")
        self.attachments = AttachmentsBar()
        self.prompt.files_given.connect(self.attachments.request)
        self.prompt.sends_empty = lambda: bool(self.attachments.pictures)
        self.box = QFrame()
        self.box.setObjectName("composerBox")
        row = QHBoxLayout(self.box)
        row.setContentsMargins(14, 8, 8, 8)
        row.setSpacing(8)
        row.addWidget(self.attach_button, 0, Qt.AlignmentFlag.AlignBottom)
        row.addWidget(self.prompt, 1)
        row.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        self.prompt.installEventFilter(self)  # the box's border shows the prompt's focus
        self.column = QWidget()  # the reading column's width, centred like the chat's text
        self.column.setMaximumWidth(theme.READING_COLUMN_PX + 2 * 24)
        inner = QVBoxLayout(self.column)
        inner.setContentsMargins(0, 0, 0, 0)
        inner.setSpacing(4)
        inner.addWidget(self.attachments)
        inner.addWidget(self.box)
        self._below = below = QHBoxLayout()
        below.setContentsMargins(8, 0, 8, 0)
        below.addWidget(self.json_chip, 0, Qt.AlignmentFlag.AlignLeft)
        below.addWidget(self.count, 1)
        inner.addLayout(below)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(24, 8, 24, 12)
        layout.addStretch(1)
        layout.addWidget(self.column, 1000)  # up to its widest; the stretches centre it
        layout.addStretch(1)
        self._counter: Callable[[str], int] | None = None
        self._context = 0
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(COUNT_DELAY_MS)
        self._timer.timeout.connect(self._update_count)
        self.prompt.textChanged.connect(self._timer.start)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self.prompt and event.type() in (QEvent.Type.FocusIn, QEvent.Type.FocusOut):
            self.box.setProperty("focused", event.type() == QEvent.Type.FocusIn)
            self.box.style().unpolish(self.box)
            self.box.style().polish(self.box)
        return False

    def add_control(self, widget: QWidget) -> None:
        """A switch of the conversation's (Think) under the prompt, left of the token count."""
        self._below.insertWidget(self._below.indexOf(self.count), widget, 0, Qt.AlignmentFlag.AlignLeft)

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
