"""The notice bar: one message laid over the top of the chat; errors stay until dismissed, information fades."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QEvent, QObject, Qt, QTimer
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QToolButton, QWidget

NOTICE_INFO_MS = 6000


class NoticeBar(QFrame):
    """A message laid over the top of the chat (it never pushes the layout); errors stay, information fades."""

    def __init__(self, parent: QWidget) -> None:
        super().__init__(parent)
        self.setObjectName("noticeBar")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.action_button = QPushButton()
        self.action_button.hide()
        close = QToolButton()
        close.setText("✕")
        close.setAutoRaise(True)
        close.setToolTip("Dismiss")
        close.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(12, 6, 6, 6)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.action_button)
        layout.addWidget(close)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.hide)
        self._action: Callable[[], None] | None = None
        self.action_button.clicked.connect(self._on_action)
        self._over = parent
        parent.installEventFilter(self)
        self.hide()

    def show_message(
        self, text: str, error: bool, action: tuple[str, Callable[[], None]] | None = None, stay: bool = False
    ) -> None:
        """Show `text` over the chat; an info message hides itself after a while unless it should `stay`."""
        self.setProperty("kind", "error" if error else "info")
        self.style().unpolish(self)
        self.style().polish(self)
        self.label.setText(text)
        self._action = action[1] if action else None
        self.action_button.setText(action[0] if action else "")
        self.action_button.setVisible(action is not None)
        self._place()
        self.show()
        self.raise_()
        if error or stay:
            self._timer.stop()
        else:
            self._timer.start(NOTICE_INFO_MS)

    def text(self) -> str:
        return "" if self.isHidden() else self.label.text()

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.Resize:
            self._place()
        return False

    def _place(self) -> None:
        width = max(200, self._over.width() - 32)
        layout = self.layout()
        assert layout is not None  # set in __init__
        # A wrapped label's own size hint assumes some other width: ask the layout for this width's height.
        height = layout.totalHeightForWidth(width) if layout.hasHeightForWidth() else self.sizeHint().height()
        self.setFixedSize(width, height)
        self.move((self._over.width() - width) // 2, 10)

    def _on_action(self) -> None:
        self.hide()
        if self._action is not None:
            self._action()
