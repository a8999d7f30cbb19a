"""The hardware policy: reads thermal and memory sources, adapts generation, and announces every decision.

It is the engine.generation.loop `Pacer`: `prefill_chunk` caps prefill chunks and `before_step` sleeps a cool-down
between tokens or, at critical, holds generation until the machine cools (or the user stops it). The scheduler
asks `max_batch`, backend selection asks `preferred_backend`, the cascade asks `episodic_budget_bytes` and
`under_pressure`, model loading calls `check_model_fits`. Each change of course is a `PolicyDecision` sent to the
listeners, so the app can say why it slowed down ("throttled: thermal serious").

Sources are read at most every `poll_interval_s` while generating (sooner when the thermal source notifies a
change); a paused generation re-reads them every `pause_poll_s`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from engine.errors import InsufficientMemory
from engine.hw.memory import MemoryPressure, MemorySnapshot, MemorySource, format_bytes
from engine.hw.thermal import ThermalSource, ThermalState


class Mode(enum.Enum):
    PERFORMANCE = "performance"
    BALANCED = "balanced"
    EFFICIENCY = "efficiency"


@dataclass(frozen=True)
class Throttle:
    """Limits in force at one thermal level; the defaults mean no limit."""

    chunk_cap: int | None = None  # largest prefill chunk, tokens
    batch_cap: int | None = None  # most sequences decoded together
    cooldown_s: float = 0.0  # sleep between tokens, lets the chip shed heat

    def as_parameters(self) -> dict[str, object]:
        return {"prefill_chunk_cap": self.chunk_cap, "batch_cap": self.batch_cap, "cooldown_s": self.cooldown_s}


@dataclass(frozen=True)
class ModeProfile:
    fair: Throttle
    serious: Throttle  # also what applies right after a critical pause ends while still serious
    prefer_efficient_backend: bool  # even when cool (efficiency mode)


PROFILES: dict[Mode, ModeProfile] = {
    Mode.PERFORMANCE: ModeProfile(Throttle(), Throttle(chunk_cap=128, batch_cap=4, cooldown_s=0.005), False),
    Mode.BALANCED: ModeProfile(Throttle(), Throttle(chunk_cap=64, batch_cap=2, cooldown_s=0.02), False),
    Mode.EFFICIENCY: ModeProfile(
        Throttle(chunk_cap=128, batch_cap=2, cooldown_s=0.01),
        Throttle(chunk_cap=32, batch_cap=1, cooldown_s=0.05),
        True,
    ),
}

# Most work per watt first: the Neural Engine, then the Apple GPU, then the CPU. CUDA is left out on purpose:
# a discrete GPU is the least efficient place to run when the machine is already hot.
EFFICIENT_BACKENDS: tuple[str, ...] = ("coreml", "mps", "cpu")


@dataclass(frozen=True)
class PolicyConfig:
    poll_interval_s: float = 1.0
    pause_poll_s: float = 0.5
    # Default memory budget: 60 % of RAM. The rest is left to macOS, the window and the user's other apps; on Apple
    # Silicon the GPU and Neural Engine draw from the same unified memory, so taking more starts swapping.
    memory_share: float = 0.6
    budget_bytes: int | None = None  # an explicit budget overrides memory_share
    # Share of the budget left after weights and working (L1) KV that goes to the episodic tier; the remainder
    # covers activations, the persistent tier's page cache and Python itself.
    episodic_share: float = 0.5
    profiles: Mapping[Mode, ModeProfile] = field(default_factory=lambda: dict(PROFILES))


class DecisionKind(enum.Enum):
    THROTTLE = "throttle"  # limits changed (smaller chunks/batches, cool-down)
    UNTHROTTLE = "unthrottle"  # limits lifted
    PAUSE = "pause"  # generation held: thermal critical
    RESUME = "resume"  # generation continues
    SPILL = "spill"  # the cascade should move episodic blocks to disk
    KEEP = "keep"  # pressure gone: episodic blocks may stay in RAM


@dataclass(frozen=True)
class PolicyDecision:
    kind: DecisionKind
    reason: str  # shown to the user as is, e.g. "throttled: thermal serious"
    parameters: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyState:
    mode: Mode
    thermal: ThermalState
    pressure: MemoryPressure
    paused: bool
    throttle: Throttle
    spilling: bool


Listener = Callable[[PolicyDecision], None]


class HardwarePolicy:
    def __init__(
        self,
        thermal: ThermalSource,
        memory: MemorySource,
        mode: Mode = Mode.BALANCED,
        config: PolicyConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.thermal = thermal
        self.memory = memory
        self.config = config or PolicyConfig()
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._mode = mode
        self._thermal_state = ThermalState.UNKNOWN
        self._pressure = MemoryPressure.UNKNOWN
        self._paused = False
        self._throttle = Throttle()
        self._spilling = False
        self._snapshot: MemorySnapshot | None = None
        self._last_read: float | None = None  # None: read on next use
        subscribe = getattr(thermal, "subscribe", None)
        self._unsubscribe = subscribe(self.mark_stale) if subscribe else (lambda: None)

    # --- listeners and state -------------------------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """`listener` receives every decision from now on (on the thread that made it); returns an unsubscribe."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def close(self) -> None:
        self._unsubscribe()

    @property
    def state(self) -> PolicyState:
        with self._lock:
            return PolicyState(
                self._mode, self._thermal_state, self._pressure, self._paused, self._throttle, self._spilling
            )

    def mark_stale(self) -> None:
        """Re-read the sources at the next step (called by thermal change notifications, from any thread)."""
        self._last_read = None

    def set_mode(self, mode: Mode) -> None:
        with self._lock:
            self._mode = mode
            decisions = self._apply_thermal(self._thermal_state)
        self._emit(decisions)

    # --- reading the sources ---------------------------------------------------------------------------------------

    def refresh(self) -> PolicyState:
        """Read both sources now and emit whatever decisions their change calls for."""
        thermal = self.thermal.read().state
        snapshot = self.memory.snapshot()
        with self._lock:
            self._last_read = self.clock()
            self._snapshot = snapshot
            decisions = self._apply_thermal(thermal) + self._apply_memory(snapshot.pressure)
        self._emit(decisions)
        return self.state

    def _refresh_if_due(self) -> None:
        last = self._last_read
        if last is None or self.clock() - last >= self.config.poll_interval_s:
            self.refresh()

    def _throttle_for(self, state: ThermalState) -> Throttle:
        profile = self.config.profiles[self._mode]
        if state.severity >= ThermalState.SERIOUS.severity:
            return profile.serious
        return profile.fair if state is ThermalState.FAIR else Throttle()

    def _apply_thermal(self, state: ThermalState) -> list[PolicyDecision]:
        """Move to `state` (lock held); returns the decisions the move makes."""
        self._thermal_state = state
        throttle = self._throttle_for(state)
        throttle_changed = throttle != self._throttle
        self._throttle = throttle
        params: dict[str, object] = {"thermal_state": state.value, "mode": self._mode.value, **throttle.as_parameters()}
        critical = state is ThermalState.CRITICAL
        # A pause or resume carries the new limits itself, so it is not followed by a separate throttle decision.
        if critical and not self._paused:
            self._paused = True
            return [PolicyDecision(DecisionKind.PAUSE, "paused: thermal critical", params)]
        if self._paused and not critical:
            self._paused = False
            return [PolicyDecision(DecisionKind.RESUME, f"resumed: thermal {state.value}", params)]
        if not throttle_changed:
            return []
        if throttle == Throttle():
            return [PolicyDecision(DecisionKind.UNTHROTTLE, f"full speed: thermal {state.value}", params)]
        return [PolicyDecision(DecisionKind.THROTTLE, f"throttled: thermal {state.value}", params)]

    def _apply_memory(self, pressure: MemoryPressure) -> list[PolicyDecision]:
        self._pressure = pressure
        spilling = pressure.severity >= MemoryPressure.WARNING.severity
        if spilling == self._spilling:
            return []
        self._spilling = spilling
        params = {"memory_pressure": pressure.value}
        if spilling:
            return [
                PolicyDecision(
                    DecisionKind.SPILL, f"spilling episodic memory to disk: memory pressure {pressure.value}", params
                )
            ]
        return [
            PolicyDecision(
                DecisionKind.KEEP, f"keeping episodic memory in RAM: memory pressure {pressure.value}", params
            )
        ]

    def _emit(self, decisions: list[PolicyDecision]) -> None:
        if not decisions:
            return
        with self._lock:
            listeners = list(self._listeners)
        for decision in decisions:
            for listener in listeners:
                listener(decision)

    # --- Pacer (engine.generation.loop) -----------------------------------------------------------------------------------

    def prefill_chunk(self, requested: int) -> int:
        # A prefill that starts at critical runs at the serious cap; the first `before_step` then holds it.
        self._refresh_if_due()
        cap = self._throttle.chunk_cap
        return max(1, min(requested, cap)) if cap else requested

    def before_step(self, should_stop: Callable[[], bool]) -> None:
        self._refresh_if_due()
        while self._paused and not should_stop():
            self.sleep(self.config.pause_poll_s)
            self.refresh()
        if self._paused:  # stopped while paused: no cool-down, the loop ends at its next should_stop check
            return
        if self._throttle.cooldown_s > 0:
            self.sleep(self._throttle.cooldown_s)

    # --- hints for the scheduler, backend choice, cascade and loader ------------------------------------------------

    def max_batch(self, requested: int) -> int:
        self._refresh_if_due()
        cap = self._throttle.batch_cap
        return max(1, min(requested, cap)) if cap else requested

    def preferred_backend(self, available: Iterable[str]) -> str | None:
        """The most efficient of `available` when hot (serious or worse) or in efficiency mode; None: no preference."""
        self._refresh_if_due()
        hot = self._thermal_state.severity >= ThermalState.SERIOUS.severity
        if not (hot or self.config.profiles[self._mode].prefer_efficient_backend):
            return None
        names = set(available)
        return next((b for b in EFFICIENT_BACKENDS if b in names), None)

    def _current_snapshot(self) -> MemorySnapshot:
        self._refresh_if_due()
        snapshot = self._snapshot
        assert snapshot is not None  # set by the refresh above or an earlier one
        return snapshot

    def budget_bytes(self) -> int:
        if self.config.budget_bytes is not None:
            return self.config.budget_bytes
        return int(self._current_snapshot().total_bytes * self.config.memory_share)

    def episodic_budget_bytes(self, weight_bytes: int, working_bytes: int) -> int:
        """Bytes for the episodic (L2) tier: a share of what the budget leaves after weights and working KV."""
        spare = self.budget_bytes() - weight_bytes - working_bytes
        return max(0, int(spare * self.config.episodic_share))

    def under_pressure(self) -> bool:
        """True while the cascade should spill episodic blocks to disk (a SPILL decision announced it)."""
        self.refresh()  # a memory snapshot costs microseconds; a stale answer could let the cascade grow into swap
        return self.state.spilling

    def check_model_fits(self, weight_bytes: int, kv_bytes: int) -> None:
        """Raise `InsufficientMemory` when weights + KV exceed both the budget and what is available now."""
        snapshot = self.memory.snapshot()
        budget = self.budget_bytes()
        need = weight_bytes + kv_bytes
        room = min(budget, snapshot.available_bytes)
        if need > room:
            raise InsufficientMemory(
                f"This model needs {format_bytes(need)} ({format_bytes(weight_bytes)} of weights and "
                f"{format_bytes(kv_bytes)} of KV cache) but only {format_bytes(room)} is free for it "
                f"({format_bytes(snapshot.available_bytes)} available, a budget of {format_bytes(budget)} of "
                f"{format_bytes(snapshot.total_bytes)} RAM); close other apps or choose a smaller model."
            )
