"""Fake thermal and memory sources and an injectable clock/sleep, for driving the policy in tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.hw.memory import MemoryPressure, MemorySnapshot
from engine.hw.thermal import ThermalReading, ThermalState

GB = 2**30
N = ThermalState.NOMINAL


@dataclass
class FakeThermal:
    state: ThermalState = N
    callbacks: list[Callable[[], None]] = field(default_factory=list)
    reads: int = 0

    def read(self) -> ThermalReading:
        self.reads += 1
        return ThermalReading(self.state, "fake")

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        self.callbacks.append(callback)
        return lambda: self.callbacks.remove(callback)

    def change(self, state: ThermalState) -> None:
        """What a macOS notification does: new state, observers told."""
        self.state = state
        for cb in list(self.callbacks):
            cb()


@dataclass
class FakeMemory:
    snap: MemorySnapshot = field(default_factory=lambda: MemorySnapshot(GB, 16 * GB, 10 * GB, MemoryPressure.NORMAL))

    def snapshot(self) -> MemorySnapshot:
        return self.snap


class FakeTime:
    """Injected clock and sleep: sleeping advances the clock and runs scheduled actions."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.on_sleep: list[Callable[[], None]] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep:
            self.on_sleep.pop(0)()
