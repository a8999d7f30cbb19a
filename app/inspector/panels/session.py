"""Session panel: the current session file, when it was saved or restored, tokens per tier, Save / Restore."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal, Slot
from PySide6.QtWidgets import QHBoxLayout, QPushButton, QWidget

from app.inspector.panels.base import PLACEHOLDER, Panel, clock_text
from app.worker.types import MemoryReport, SessionFileEvent


class SessionPanel(Panel):
    save_requested = Signal()
    restore_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Session", "sessionPanel", parent)
        self.file = self.value_row("File", wrap=True)
        self.file.setText("not saved yet")
        self.when = self.value_row("Last")
        self.tokens = self.value_row("Tokens", wrap=True)
        buttons = QHBoxLayout()
        self.save_button = QPushButton("Save…")
        self.restore_button = QPushButton("Restore…")
        self.save_button.clicked.connect(self.save_requested)
        self.restore_button.clicked.connect(self.restore_requested)
        buttons.addWidget(self.save_button)
        buttons.addWidget(self.restore_button)
        buttons.addStretch(1)
        self.layout_.addLayout(buttons)

    @Slot(SessionFileEvent)
    def on_file_event(self, event: SessionFileEvent) -> None:
        self.file.setText(event.path.name)
        self.file.setToolTip(str(event.path))
        self.when.setText(f"{event.kind} at {clock_text(event.when)}" + (f" ({event.note})" if event.note else ""))

    def show_untitled(self, previous: Path | None) -> None:
        self.file.setText("not saved yet")
        self.file.setToolTip("")
        self.when.setText(PLACEHOLDER if previous is None else f"new chat (was {previous.name})")

    @Slot(MemoryReport)
    def on_memory(self, report: MemoryReport) -> None:
        if report.remote:
            self.tokens.setText("no memory to save: a remote model's conversation is stored as its transcript")
            return
        if not report.tiers:
            self.tokens.setText(PLACEHOLDER)
            return
        per_tier = " · ".join(f"{t.name} {t.entries:,}" for t in report.tiers)
        self.tokens.setText(f"{report.tokens:,} in memory\n{per_tier}")
