"""Performance panel: the backend in use and why faster ones were skipped, time to first token, tokens/s."""

from __future__ import annotations

from PySide6.QtCore import Slot
from PySide6.QtWidgets import QWidget

from app.panels.base import Panel
from app.worker_types import ModelInfo, TurnProgress


class PerformancePanel(Panel):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Performance", "performancePanel", parent)
        self.backend = self.value_row("Backend")
        self.skipped = self.value_row("Skipped", wrap=True)
        self.ttft = self.value_row("First token")
        self.speed = self.value_row("Speed")
        self.tokens = self.value_row("Tokens")

    @Slot(ModelInfo)
    def _on_model(self, info: ModelInfo) -> None:
        runs, _, why = info.backend_detail.partition(" (skipped ")
        self.backend.setText(runs)  # the backend and its weights, e.g. "cpu, q4_1 weights, native avx2 kernels"
        self.skipped.setText(why.removesuffix(")").replace("; ", "\n") if why else "none: the fastest backend runs")

    @Slot(TurnProgress)
    def _on_progress(self, p: TurnProgress) -> None:
        if p.generated_tokens:
            self.ttft.setText(f"{p.ttft_s * 1000:.0f} ms")
            self.speed.setText(f"{p.tokens_per_s:.1f} tokens/s")
        self.tokens.setText(f"{p.prompt_tokens:,} prompt · {p.generated_tokens:,} generated")
