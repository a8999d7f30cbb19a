"""What every panel shares: a dock with a titled form of read-only values."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDockWidget, QFormLayout, QLabel, QVBoxLayout, QWidget

from engine.hw.memory import format_bytes

PLACEHOLDER = "—"


def bytes_text(n: int) -> str:
    return format_bytes(n)


def clock_text(epoch_s: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch_s))


class Panel(QDockWidget):
    def __init__(self, title: str, object_name: str, parent: QWidget | None = None) -> None:
        super().__init__(title, parent)
        # saveState/restoreState identify docks by object name: it must be stable across versions.
        self.setObjectName(object_name)
        self.setFeatures(
            QDockWidget.DockWidgetFeature.DockWidgetClosable
            | QDockWidget.DockWidgetFeature.DockWidgetMovable
            | QDockWidget.DockWidgetFeature.DockWidgetFloatable
        )
        body = QWidget()
        body.setObjectName("panelBody")
        self.layout_ = QVBoxLayout(body)
        self.layout_.setContentsMargins(12, 8, 12, 10)
        self.layout_.setSpacing(6)
        self.form = QFormLayout()
        self.form.setLabelAlignment(Qt.AlignmentFlag.AlignRight)
        self.form.setHorizontalSpacing(10)
        self.form.setVerticalSpacing(4)
        self.layout_.addLayout(self.form)
        self.setWidget(body)

    def value_row(self, label: str, wrap: bool = False) -> QLabel:
        value = QLabel(PLACEHOLDER)
        value.setObjectName("panelValue")
        value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        value.setWordWrap(wrap)
        self.form.addRow(f"{label}:", value)
        return value

    def finish(self) -> None:
        self.layout_.addStretch(1)
