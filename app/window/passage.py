"""The passage a reply drew on, shown when its citation under the reply is clicked: where it is (file, page, lines)
and its text as the model read it, in a small window of its own that does not block the chat."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QPlainTextEdit, QVBoxLayout, QWidget

from app.worker.types import CitationView

PASSAGE_WIDTH = 520
PASSAGE_HEIGHT = 320


class PassageDialog(QDialog):
    def __init__(self, citation: CitationView, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("passageDialog")
        self.setWindowTitle(citation.source)
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.where = QLabel(citation.label)
        self.where.setObjectName("passageWhere")
        self.where.setWordWrap(True)
        self.where.setTextFormat(Qt.TextFormat.PlainText)  # a file's name is text, never markup
        self.text = QPlainTextEdit(citation.text)
        self.text.setObjectName("passageText")
        self.text.setReadOnly(True)
        self.text.setAccessibleName(f"The passage from {citation.label}")
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.close)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 16, 16, 12)
        layout.setSpacing(8)
        layout.addWidget(self.where)
        layout.addWidget(self.text, 1)
        layout.addWidget(buttons)
        self.resize(PASSAGE_WIDTH, PASSAGE_HEIGHT)


def show_passage(parent: QWidget, citation: CitationView) -> PassageDialog:
    """Open the passage beside the chat (not modal: the user may read on, or open another)."""
    dialog = PassageDialog(citation, parent)
    dialog.show()
    return dialog
