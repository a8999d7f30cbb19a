"""Cache panel: each memory tier's fill, bytes, hit rate and evictions, live while a reply streams."""

from __future__ import annotations

from PySide6.QtCore import Slot
from PySide6.QtWidgets import QFormLayout, QLabel, QProgressBar, QWidget

from app.inspector.panels.base import Panel, bytes_text
from app.worker.types import MemoryReport
from engine import TierStats

TIER_TITLES = {"working": "Working (L1)", "episodic": "Episodic (L2)", "persistent": "Persistent (L3)"}


class _TierRows:
    def __init__(self, form: QFormLayout, name: str) -> None:
        self.title = QLabel(TIER_TITLES.get(name, name.title()))
        self.title.setObjectName("panelSection")
        self.fill = QProgressBar()
        self.fill.setRange(0, 1000)
        self.fill.setTextVisible(False)
        self.fill.setFixedHeight(6)
        self.detail = QLabel()
        self.detail.setObjectName("panelValue")
        self.detail.setWordWrap(True)  # the inspector is narrow: wrap rather than cut off
        form.addRow(self.title)
        form.addRow(self.fill)
        form.addRow(self.detail)

    def show(self, tier: TierStats) -> None:
        share = tier.bytes / tier.capacity_bytes if tier.capacity_bytes else 0.0
        self.fill.setValue(int(min(share, 1.0) * 1000))
        self.fill.setToolTip(f"{share:.0%} full")
        looked_up = tier.hits + tier.misses
        hit = f"{tier.hit_rate:.0%} hits" if looked_up else "no lookups yet"
        capacity = f" of {bytes_text(tier.capacity_bytes)}" if tier.capacity_bytes else ""
        self.detail.setText(
            f"{tier.entries:,} entries · {bytes_text(tier.bytes)}{capacity}\n{hit} · {tier.evictions:,} evictions"
        )


class CachePanel(Panel):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Cache", "cachePanel", parent)
        self._empty = QLabel("No model loaded.")
        self._empty.setObjectName("panelHint")
        self.form.addRow(self._empty)
        self._rows: dict[str, _TierRows] = {}

    @Slot(MemoryReport)
    def on_memory(self, report: MemoryReport) -> None:
        names = [t.name for t in report.tiers]
        if names != list(self._rows) or not names:
            while self.form.rowCount():
                self.form.removeRow(0)
            self._rows = {n: _TierRows(self.form, n) for n in names}
            if not names:
                hint = (
                    "The memory cascade does not apply to a remote model: the server keeps its own memory."
                    if report.remote
                    else "No model loaded."
                )
                self._empty = QLabel(hint)
                self._empty.setObjectName("panelHint")
                self._empty.setWordWrap(True)
                self.form.addRow(self._empty)
        for tier in report.tiers:
            self._rows[tier.name].show(tier)
