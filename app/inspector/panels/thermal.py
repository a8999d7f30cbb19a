"""Thermal panel: the machine's thermal state and what the engine is doing about it."""

from __future__ import annotations

from PySide6.QtCore import Slot
from PySide6.QtWidgets import QWidget

from app.inspector.hw_monitor import HardwareSample
from app.inspector.panels.base import Panel
from engine.hw import PolicyDecision, ThermalState

STATE_TEXT = {
    ThermalState.NOMINAL: ("●", "#34c759", "Nominal"),
    ThermalState.FAIR: ("●", "#ffcc00", "Fair"),
    ThermalState.SERIOUS: ("●", "#ff9500", "Serious"),
    ThermalState.CRITICAL: ("●", "#ff3b30", "Critical"),
    ThermalState.UNKNOWN: ("○", "#8e8e93", "Unknown"),
}


class ThermalPanel(Panel):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Thermal", "thermalPanel", parent)
        self.state = self.value_row("State")
        self.source = self.value_row("Source", wrap=True)
        self.action = self.value_row("Engine", wrap=True)
        self.limits = self.value_row("Limits", wrap=True)
        self.action.setText("full speed")

    @Slot(HardwareSample)
    def on_sample(self, sample: HardwareSample) -> None:
        mark, color, name = STATE_TEXT[sample.thermal.state]
        self.state.setText(f'<span style="color:{color}">{mark}</span> {name}')
        r = sample.thermal
        where = (
            r.source
            + (f" · {r.sensor}" if r.sensor else "")
            + (f" · {r.celsius:.0f} °C" if r.celsius is not None else "")
        )
        self.source.setText(where)
        t = sample.policy.throttle
        parts = []
        if t.chunk_cap:
            parts.append(f"prefill ≤ {t.chunk_cap} tokens")
        if t.cooldown_s:
            parts.append(f"{t.cooldown_s * 1000:.0f} ms pause per token")
        if sample.policy.paused:
            parts.append("paused until it cools")
        self.limits.setText(", ".join(parts) if parts else "none")

    @Slot(PolicyDecision)
    def on_decision(self, decision: PolicyDecision) -> None:
        if decision.kind.value in ("throttle", "unthrottle", "pause", "resume"):
            self.action.setText(decision.reason)
