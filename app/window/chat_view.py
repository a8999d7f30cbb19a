"""The transcript view and the prompt box.

The view appends streamed text at the end of the document with a cursor (no re-layout of earlier messages), and
only when a reply ends re-renders that one message with code blocks in a monospace font. Each message's header
carries "Copy" and "Branch" links (anchors `copy:N` / `branch:N`, N = the message's index in the conversation);
while a prompt is read, the reply bubble shows how far the reading got instead of an empty label.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from PySide6.QtCore import Qt, QUrl, Signal, Slot
from PySide6.QtGui import (
    QColor,
    QDesktopServices,
    QFont,
    QFontDatabase,
    QGuiApplication,
    QKeyEvent,
    QPalette,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextFrame,
    QTextFrameFormat,
)
from PySide6.QtWidgets import QPlainTextEdit, QTextBrowser, QWidget

from app.worker.types import MessageView

ROLE_LABELS = {"user": "You", "assistant": "Spark", "system": "System"}
ROLE_PROPERTY = 0x100000  # QTextFormat.UserProperty: marks each message frame with its role
INDEX_PROPERTY = 0x100001  # ...and with its index in the conversation
FENCE = re.compile(r"```[^\n]*\n?(.*?)(?:```|$)", re.DOTALL)


def _mix(a: QColor, b: QColor, t: float) -> QColor:
    ca, cb = (a.redF(), a.greenF(), a.blueF()), (b.redF(), b.greenF(), b.blueF())
    return QColor.fromRgbF(*(x + (y - x) * t for x, y in zip(ca, cb, strict=True)))


class ChatView(QTextBrowser):
    branch_requested = Signal(int)  # the message's index in the conversation
    copied = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setOpenLinks(False)  # copy:/branch: are ours; web links go to the browser in _on_anchor
        self.anchorClicked.connect(self._on_anchor)
        self.setFrameShape(QTextBrowser.Shape.NoFrame)
        self.document().setDocumentMargin(18)
        self._reply: QTextFrame | None = None
        self._reply_text: list[str] = []  # the streamed reply as received (the document would normalise it)
        self._reading = False  # the reply bubble shows reading progress, not text yet
        self._contents: dict[int, str] = {}  # message index -> its text as received (what Copy copies)
        self._next_index = 0
        self._mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)

    # -- public ------------------------------------------------------------------------------------------------------
    def set_messages(self, messages: Sequence[MessageView], notes: dict[int, str] | None = None) -> None:
        """Show a whole conversation; `notes` are the remarks that were shown under some of its messages."""
        self.clear()
        self._reply = None
        self._reading = False
        self._contents = {}
        for i, m in enumerate(messages):
            if m.role != "system":
                frame = self._add_message(m.role, m.content, i)
                if notes and notes.get(i):
                    self._add_note(frame, notes[i])
        self._next_index = len(messages)
        self._scroll_to_end()

    def last_index(self) -> int:
        """The index of the newest message shown (the reply that just ended)."""
        return self._next_index - 1

    def add_user_message(self, text: str) -> None:
        self._add_message("user", text, self._next_index)
        self._next_index += 1
        self._scroll_to_end()

    def begin_reply(self) -> None:
        self._reply = self._add_message("assistant", "", self._next_index, links=False)
        self._next_index += 1
        self._reply_text = []
        self._scroll_to_end()

    def show_reading(self, text: str) -> None:
        """While the prompt is read: `text` (tokens read, rate, time left) in the reply bubble, dimmed."""
        if self._reply is None or self._reply_text:
            return
        self._clear_frame(self._reply)
        self._fill(self._reply, "assistant", "", links=False)
        at_end = self._at_end()
        self._reply.lastCursorPosition().insertText(text, self._note_format())
        self._reading = True
        if at_end:
            self._scroll_to_end()

    def append_reply(self, text: str) -> None:
        if self._reply is None:
            return
        at_end = self._at_end()
        if self._reading:
            self._clear_frame(self._reply)
            self._fill(self._reply, "assistant", "", links=False)
            self._reading = False
        self._reply_text.append(text)
        cursor = self._reply.lastCursorPosition()
        cursor.insertText(text, self._body_format())
        if at_end:
            self._scroll_to_end()

    def remove_last_reply(self) -> None:
        """Regenerate: the last answer goes away before the new one streams in."""
        frames = self._frames("assistant")
        if not frames:
            return
        frame = frames[-1]
        index = frame.frameFormat().property(INDEX_PROPERTY)
        cursor = QTextCursor(self.document())
        cursor.setPosition(frame.firstPosition() - 1)
        cursor.setPosition(frame.lastPosition() + 1, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        if isinstance(index, int):
            self._contents.pop(index, None)
            self._next_index = index

    def end_reply(self, note: str = "") -> None:
        """Re-render the finished reply with code formatting; `note` (e.g. "stopped") goes under it, dimmed."""
        frame = self._reply
        self._reply = None
        self._reading = False
        if frame is None:
            return
        text = "".join(self._reply_text)
        if not text:  # nothing was written (stopped while reading, an error): no empty bubble, the note stays
            self.remove_last_reply()  # the reply frame is the last assistant frame
            frames = self._frames("assistant") + self._frames("user")
            if not note or not frames:
                return
            frame = max(frames, key=lambda f: f.lastPosition())
        else:
            self._clear_frame(frame)
            self._fill(frame, "assistant", text)
            index = frame.frameFormat().property(INDEX_PROPERTY)
            if isinstance(index, int):
                self._contents[index] = text
        if note:  # under the message, outside its frame: a remark about the turn, not part of the reply
            self._add_note(frame, note)
        self._scroll_to_end()

    def _add_note(self, frame: QTextFrame, note: str) -> None:
        after = QTextCursor(self.document())
        after.setPosition(frame.lastPosition() + 1)
        block = QTextBlockFormat()
        block.setLeftMargin(10)
        after.setBlockFormat(block)  # the empty block Qt keeps after every frame
        after.insertText(note, self._note_format())

    def reply_text(self) -> str:
        """The text of the last assistant message as shown (for tests and Copy)."""
        frames = self._frames("assistant")
        return self._frame_body(frames[-1]) if frames else ""

    def message_text(self, index: int) -> str:
        return self._contents.get(index, "")

    def copy_message(self, index: int) -> None:
        QGuiApplication.clipboard().setText(self._contents.get(index, ""))
        self.copied.emit(index)

    @Slot(QUrl)
    def _on_anchor(self, url: QUrl) -> None:
        scheme, _, arg = url.toString().partition(":")
        if scheme in ("copy", "branch") and arg.isdigit():
            (self.copy_message if scheme == "copy" else self.branch_requested.emit)(int(arg))
        elif url.scheme() in ("http", "https"):
            QDesktopServices.openUrl(url)

    def _clear_frame(self, frame: QTextFrame) -> None:
        cursor = frame.firstCursorPosition()
        cursor.setPosition(frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()

    def _frames(self, role: str) -> list[QTextFrame]:
        return [f for f in self.document().rootFrame().childFrames() if f.frameFormat().property(ROLE_PROPERTY) == role]

    # -- rendering ---------------------------------------------------------------------------------------------------
    def _add_message(self, role: str, content: str, index: int, links: bool = True) -> QTextFrame:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        fmt = QTextFrameFormat()
        fmt.setPadding(10)
        fmt.setTopMargin(6)
        fmt.setBottomMargin(6)
        fmt.setBorder(0)
        if role == "user":
            pal = self.palette()
            fmt.setBackground(_mix(pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Highlight), 0.12))
            fmt.setLeftMargin(48)
        else:
            fmt.setRightMargin(48)
        fmt.setProperty(ROLE_PROPERTY, role)
        fmt.setProperty(INDEX_PROPERTY, index)
        frame = cursor.insertFrame(fmt)
        self._fill(frame, role, content, links)
        self._contents[index] = content
        return frame

    def _fill(self, frame: QTextFrame, role: str, content: str, links: bool = True) -> None:
        cursor = frame.firstCursorPosition()
        cursor.setBlockFormat(QTextBlockFormat())
        cursor.insertText(ROLE_LABELS.get(role, role.title()), self._label_format())
        index = frame.frameFormat().property(INDEX_PROPERTY)
        if isinstance(index, int) and links:  # a streaming reply gets its links once it is finished
            cursor.insertText("    ", self._label_format())
            cursor.insertText("Copy", self._link_format(f"copy:{index}", "Copy this message"))
            cursor.insertText("  ·  ", self._label_format())
            cursor.insertText(
                "Branch", self._link_format(f"branch:{index}", "A new conversation up to this message, with its memory")
            )
        cursor.insertBlock(QTextBlockFormat(), self._body_format())
        at = 0
        for match in FENCE.finditer(content):
            cursor.insertText(content[at : match.start()].strip("\n"), self._body_format())
            code = QTextFrameFormat()
            code.setPadding(8)
            code.setTopMargin(4)
            code.setBottomMargin(4)
            code.setBackground(self.palette().color(QPalette.ColorRole.AlternateBase))
            code_frame = cursor.insertFrame(code)
            inner = code_frame.firstCursorPosition()
            inner.insertText(match.group(1).rstrip("\n"), self._code_format())
            cursor = frame.lastCursorPosition()
            at = match.end()
        cursor.insertText(content[at:].lstrip("\n") if at else content, self._body_format())

    def _frame_body(self, frame: QTextFrame) -> str:
        cursor = frame.firstCursorPosition()
        cursor.setPosition(frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        return cursor.selectedText().replace("\u2029", "\n").partition("\n")[2]

    def _label_format(self) -> QTextCharFormat:
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.DemiBold)
        fmt.setFontPointSize(max(self.font().pointSizeF() - 1, 8))
        fmt.setForeground(self.palette().color(QPalette.ColorRole.PlaceholderText))
        return fmt

    def _link_format(self, href: str, tip: str) -> QTextCharFormat:
        fmt = self._label_format()
        fmt.setFontWeight(QFont.Weight.Normal)
        fmt.setAnchor(True)
        fmt.setAnchorHref(href)
        fmt.setToolTip(tip)
        fmt.setForeground(self.palette().color(QPalette.ColorRole.Link))
        return fmt

    def _body_format(self) -> QTextCharFormat:
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.Normal)
        fmt.setFontPointSize(self.font().pointSizeF())
        fmt.setForeground(self.palette().color(QPalette.ColorRole.Text))
        return fmt

    def _code_format(self) -> QTextCharFormat:
        fmt = QTextCharFormat()
        fmt.setFont(self._mono)
        fmt.setForeground(self.palette().color(QPalette.ColorRole.Text))
        return fmt

    def _note_format(self) -> QTextCharFormat:
        fmt = self._label_format()
        fmt.setFontWeight(QFont.Weight.Normal)
        fmt.setFontItalic(True)
        return fmt

    def _at_end(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4

    def _scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())


class PromptEdit(QPlainTextEdit):
    """Return sends, Shift+Return starts a new line (as in Messages). The window decides whether a send is taken
    now (it says why not, e.g. while a reply is being written); the text stays until it is."""

    submitted = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("promptEdit")
        self.setPlaceholderText("Message Spark…  (Return to send, Shift+Return for a new line)")
        self.setTabChangesFocus(True)
        line = self.fontMetrics().lineSpacing()
        self.setFixedHeight(int(line * 3 + 2 * self.document().documentMargin() + 8))

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
