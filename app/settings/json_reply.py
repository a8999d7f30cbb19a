""" "Reply as JSON": the schema a conversation's replies follow, edited in a small dialog and checked by the engine
(the same check a reply's grammar gets), so a schema the engine refuses is one sentence here, never a failed turn."""

from __future__ import annotations

import json

from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QPlainTextEdit, QVBoxLayout, QWidget

from engine import Grammar, GrammarError, json_schema_grammar

EXAMPLE_SCHEMA = """{
  "type": "object",
  "properties": {"answer": {"type": "string", "maxLength": 200}},
  "required": ["answer"],
  "additionalProperties": false
}"""


def schema_grammar(text: str) -> Grammar:
    """The grammar replies follow for the schema `text`; raises GrammarError with one sentence."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(
            f"The schema is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})."
        ) from None
    except RecursionError:
        raise GrammarError("The schema nests too deeply to read.") from None
    return json_schema_grammar(schema)


class SchemaDialog(QDialog):
    """A JSON text box; OK only with a schema the engine accepts (else its sentence shows under the box)."""

    def __init__(self, current: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Reply as JSON")
        intro = QLabel("Replies in this conversation will be JSON matching this schema (JSON Schema):")
        intro.setWordWrap(True)
        self.editor = QPlainTextEdit(current or EXAMPLE_SCHEMA)
        self.editor.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.error = QLabel()
        self.error.setObjectName("dialogError")
        self.error.setWordWrap(True)
        self.error.hide()
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel | QDialogButtonBox.StandardButton.Ok)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addWidget(self.editor, 1)
        layout.addWidget(self.error)
        layout.addWidget(buttons)

    def value(self) -> str:
        return self.editor.toPlainText().strip()

    def accept(self) -> None:
        try:
            schema_grammar(self.value())
        except GrammarError as exc:
            self.error.setText(str(exc))
            self.error.show()
            return
        super().accept()
