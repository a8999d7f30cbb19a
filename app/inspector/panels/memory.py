"""Memory panel: process RSS, system available memory, device memory, model bytes, cascade bytes vs budget."""

from __future__ import annotations

from PySide6.QtCore import Slot
from PySide6.QtWidgets import QWidget

from app.inspector.hw_monitor import HardwareSample
from app.inspector.panels.base import Panel, bytes_text
from app.worker.types import MemoryReport, ModelInfo


class MemoryPanel(Panel):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Memory", "memoryPanel", parent)
        self.rss = self.value_row("This app")
        self.available = self.value_row("Available")
        self.pressure = self.value_row("Pressure")
        self.device = self.value_row("Device")
        self.model = self.value_row("Model weights")
        self.cache = self.value_row("KV cache")
        self.budget = self.value_row("Budget")

    @Slot(HardwareSample)
    def on_sample(self, sample: HardwareSample) -> None:
        m = sample.memory
        self.rss.setText(bytes_text(m.rss_bytes))
        self.available.setText(f"{bytes_text(m.available_bytes)} of {bytes_text(m.total_bytes)}")
        self.pressure.setText(m.pressure.value.title())
        self.device.setText(
            f"{bytes_text(m.device.allocated_bytes)} in use, {bytes_text(m.device.reserved_bytes)} held ({m.device.backend})"
            if m.device
            else "shared with the CPU"
        )
        self.budget.setText(f"{bytes_text(sample.budget_bytes)} ({sample.budget_share:.0%} of RAM)")

    @Slot(ModelInfo)
    def on_model(self, info: ModelInfo) -> None:
        self.model.setText(bytes_text(info.weight_bytes))

    @Slot(MemoryReport)
    def on_memory(self, report: MemoryReport) -> None:
        if report.remote:
            self.cache.setText("does not apply (remote model)")
            return
        used = sum(t.bytes for t in report.tiers)
        capacity = sum(t.capacity_bytes for t in report.tiers)
        self.cache.setText(f"{bytes_text(used)} of {bytes_text(capacity)}" if capacity else bytes_text(used))
