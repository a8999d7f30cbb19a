"""Performance panel: the backend in use and why faster ones were skipped, time to first token, tokens/s, and with
speculation on the tokens each decode forward gave."""

from __future__ import annotations

from PySide6.QtCore import Slot
from PySide6.QtWidgets import QWidget

from app.inspector.panels.base import PLACEHOLDER, Panel
from app.worker.types import ModelInfo, Speculating, TurnProgress


class PerformancePanel(Panel):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Performance", "performancePanel", parent)
        self.backend = self.value_row("Backend")
        self.skipped = self.value_row("Skipped", wrap=True)
        self.ttft = self.value_row("First token")
        self.speed = self.value_row("Speed")
        self.tokens = self.value_row("Tokens")
        self.per_forward = self.value_row("Per forward")  # speculation: tokens one decode forward gave

    @Slot(ModelInfo)
    def on_model(self, info: ModelInfo) -> None:
        runs, _, why = info.backend_detail.partition(" (skipped ")
        backend, _, rest = runs.partition(", ")
        if not (rest.startswith(("int", "q", "fp", "bf", "f16", "f32")) or "weights" in rest.split(",")[0]):
            own = "fp32 weights (full precision)" if backend == "cpu" else "its own precision"
            runs = ", ".join(p for p in (backend, own, rest) if p)
        self.backend.setText(runs)  # the backend and its weights, e.g. "cpu, q4_1 weights, native avx2 kernels"
        self.skipped.setText(why.removesuffix(")").replace("; ", "\n") if why else "none: the fastest backend runs")

    def reset(self) -> None:
        """A new conversation: its figures are not the previous one's."""
        for row in (self.ttft, self.speed, self.tokens, self.per_forward):
            row.setText(PLACEHOLDER)

    @Slot(TurnProgress)
    def on_progress(self, p: TurnProgress) -> None:
        if p.generated_tokens:
            self.ttft.setText(f"{p.ttft_s * 1000:.0f} ms")
            self.speed.setText(f"{p.tokens_per_s:.1f} tokens/s")
        self.tokens.setText(f"{p.prompt_tokens:,} prompt · {p.generated_tokens:,} generated")
        if p.speculating is Speculating.ON:
            per_forward = f"{p.tokens_per_forward:.2f} tokens (speculative decoding)" if p.tokens_per_forward else ""
        elif p.speculating is Speculating.UNUSED:
            per_forward = "1 token (speculation would not speed up this reply here)"
        else:
            per_forward = "speculation off"
        self.per_forward.setText(per_forward or PLACEHOLDER)
