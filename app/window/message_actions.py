"""A message's actions, shown as icons while the pointer is over it: Copy, Branch from here, and Regenerate on the
last reply. Copy answers in place: its icon becomes a tick and its name "Copied" for a moment."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QToolButton, QWidget

from app.misc.ui_icons import icon

COPIED_MS = 1500
COPY_WORDS = "Copy message"
COPIED_WORDS = "Copied"


def _button(name: str, words: str) -> QToolButton:
    b = QToolButton()
    b.setIcon(icon(name))
    b.setIconSize(QSize(16, 16))
    b.setToolTip(words)
    b.setAccessibleName(words)
    b.setAutoRaise(True)
    return b


class MessageActions(QFrame):
    copy_clicked = Signal(int)  # the message's index
    branch_clicked = Signal(int)
    regenerate_clicked = Signal()

    def __init__(self, parent: QWidget) -> None:
        super().__init__(parent)
        self.setObjectName("messageActions")
        self.index = -1
        self.copy_button = _button("copy", COPY_WORDS)
        self.branch_button = _button("branch", "Branch from here: a new conversation up to this message")
        self.regenerate_button = _button("regenerate", "Regenerate this reply")
        row = QHBoxLayout(self)
        row.setContentsMargins(2, 2, 2, 2)
        row.setSpacing(2)
        for b in (self.copy_button, self.branch_button, self.regenerate_button):
            row.addWidget(b)
        self.copy_button.clicked.connect(lambda: self.copy_clicked.emit(self.index))
        self.branch_button.clicked.connect(lambda: self.branch_clicked.emit(self.index))
        self.regenerate_button.clicked.connect(self.regenerate_clicked.emit)
        self._restore = QTimer(self)
        self._restore.setSingleShot(True)
        self._restore.timeout.connect(self._copy_again)
        self.hide()

    def show_for(self, index: int, last_reply: bool) -> None:
        if index != self.index:
            self._copy_again()
        self.index = index
        self.regenerate_button.setVisible(last_reply)
        self.adjustSize()
        self.show()
        self.raise_()

    def flash_copied(self) -> None:
        self.copy_button.setIcon(icon("check"))
        self.copy_button.setText(COPIED_WORDS)
        self.copy_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.adjustSize()
        self.copy_button.setToolTip(COPIED_WORDS)
        self.copy_button.setAccessibleName(COPIED_WORDS)
        self._restore.start(COPIED_MS)

    def copied_shown(self) -> bool:
        return self.copy_button.accessibleName() == COPIED_WORDS

    def _copy_again(self) -> None:
        self._restore.stop()
        self.copy_button.setIcon(icon("copy"))
        self.copy_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonIconOnly)
        self.adjustSize()
        self.copy_button.setToolTip(COPY_WORDS)
        self.copy_button.setAccessibleName(COPY_WORDS)
