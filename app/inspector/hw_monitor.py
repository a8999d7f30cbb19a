"""Samples the machine once a second for the Thermal and Memory panels (the reads cost microseconds).

It shares the sources with the engine's HardwarePolicy, so the panels show exactly what the policy acts on, and
tells the memory source what the loaded model and its cache hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from app.worker.types import MemoryReport, ModelInfo
from engine.hw import HardwarePolicy, MemorySnapshot, PolicyState, SystemMemorySource, ThermalReading

SAMPLE_MS = 1000


@dataclass(frozen=True)
class HardwareSample:
    thermal: ThermalReading
    memory: MemorySnapshot
    policy: PolicyState
    budget_bytes: int
    budget_share: float


class HardwareMonitor(QObject):
    sampled = Signal(HardwareSample)

    def __init__(self, policy: HardwarePolicy, memory: SystemMemorySource, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._policy = policy
        self._memory = memory
        self._tier_bytes: dict[str, int] = {}
        self._timer = QTimer(self)
        self._timer.setInterval(SAMPLE_MS)
        self._timer.timeout.connect(self._on_tick)

    def start(self) -> None:
        self._on_tick()
        self._timer.start()

    @Slot(ModelInfo)
    def on_model(self, info: ModelInfo) -> None:
        # The policy may read the source from the worker thread; it gets a copy of the last report, never a live view.
        self._memory.attach_model(info.weight_bytes, lambda: dict(self._tier_bytes), info.backend)

    @Slot(MemoryReport)
    def on_memory(self, report: MemoryReport) -> None:
        self._tier_bytes = {t.name: t.bytes for t in report.tiers}

    @Slot()
    def _on_tick(self) -> None:
        snapshot = self._memory.snapshot()
        budget = self._policy.budget_bytes()
        share = budget / snapshot.total_bytes if snapshot.total_bytes else 0.0
        self.sampled.emit(HardwareSample(self._policy.thermal.read(), snapshot, self._policy.state, budget, share))
