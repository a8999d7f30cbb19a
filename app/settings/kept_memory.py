"""Settings' Kept Memory group: the disk the kept conversation memories use (engine.session.kept), their budget
(changeable; a smaller one deletes the least recently used at once) and Clear. Clearing loses no conversation:
each compact record stays, and a conversation opened afterwards recomputes its memory once."""

from __future__ import annotations

from PySide6.QtCore import Slot
from PySide6.QtWidgets import QDoubleSpinBox, QGroupBox, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app.settings.preferences import Preferences
from engine import KeptMemory
from engine.hw import format_bytes

GB = 1024**3
MAX_BUDGET_GB = 1024.0


class KeptMemoryControl:
    """The one kept-memory folder the chat's worker writes, with its budget persisted in the preferences (the
    worker and Settings share this object: the budget is one number, read at each write)."""

    def __init__(self, kept: KeptMemory, prefs: Preferences) -> None:
        self.kept = kept
        self._prefs = prefs

    def usage_words(self) -> str:
        u = self.kept.usage()
        n = f"{u.entries} conversation{'s' if u.entries != 1 else ''}"
        return f"Kept on disk: {format_bytes(u.bytes)} for {n}, of a budget of {format_bytes(u.budget_bytes)}."

    def set_budget(self, budget_bytes: int) -> None:
        self._prefs.set_kept_budget_bytes(budget_bytes)
        self.kept.set_budget(budget_bytes)

    def clear(self) -> int:
        return self.kept.clear()


class KeptMemoryGroup(QGroupBox):
    """What the kept memory uses, its budget (applied with the dialog's OK) and Clear (at once)."""

    def __init__(self, control: KeptMemoryControl, parent: QWidget | None = None) -> None:
        super().__init__("Kept Memory", parent)
        self._control = control
        hint = QLabel(
            "Spark keeps each recent conversation's memory on disk, so switching back or reopening after a restart "
            "reads it instead of recomputing it. Clearing loses no conversation: each recomputes once when opened."
        )
        hint.setWordWrap(True)
        self.usage = QLabel()
        self.budget = QDoubleSpinBox()
        self.budget.setRange(0.0, MAX_BUDGET_GB)
        self.budget.setDecimals(1)
        self.budget.setSingleStep(0.5)
        self.budget.setSuffix(" GB")
        self.budget.setValue(control.kept.budget_bytes / GB)
        self.clear_button = QPushButton("Clear")
        self.clear_button.clicked.connect(self._on_clear)
        row = QHBoxLayout()
        row.addWidget(QLabel("Disk budget:"))
        row.addWidget(self.budget)
        row.addStretch(1)
        row.addWidget(self.clear_button)
        box = QVBoxLayout(self)
        box.addWidget(hint)
        box.addWidget(self.usage)
        box.addLayout(row)
        self.refresh()

    def refresh(self) -> None:
        self.usage.setText(self._control.usage_words())

    def apply(self) -> None:
        """The budget as edited (the dialog's OK)."""
        budget = round(self.budget.value() * GB)
        if budget != self._control.kept.budget_bytes:
            self._control.set_budget(budget)

    @Slot()
    def _on_clear(self) -> None:
        self._control.clear()
        self.refresh()
