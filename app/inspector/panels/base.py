"""What every detail panel of the inspector shares: a titled form of read-only values."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFormLayout, QLabel, QVBoxLayout, QWidget

from engine.hw import format_bytes

PLACEHOLDER = "—"


def bytes_text(n: int) -> str:
    return format_bytes(n)


def clock_text(epoch_s: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch_s))


class Panel(QWidget):
    def __init__(self, title: str, object_name: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName(object_name)
        self.title = title
        self.layout_ = QVBoxLayout(self)
        self.layout_.setContentsMargins(0, 4, 0, 6)
        self.layout_.setSpacing(4)
        heading = QLabel(title)
        heading.setObjectName("panelSection")
        self.layout_.addWidget(heading)
        self.form = QFormLayout()
        self.form.setLabelAlignment(Qt.AlignmentFlag.AlignRight)
        self.form.setHorizontalSpacing(10)
        self.form.setVerticalSpacing(4)
        self.form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.layout_.addLayout(self.form)

    def value_row(self, label: str, wrap: bool = True) -> QLabel:
        value = QLabel(PLACEHOLDER)
        value.setObjectName("panelValue")
        value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        value.setWordWrap(wrap)
        self.form.addRow(f"{label}:", value)
        return value
