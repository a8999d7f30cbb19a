"""Thermal state: one of nominal / fair / serious / critical, or `unknown` when this machine offers no source.

macOS reports the state itself (NSProcessInfo.thermalState, the same signal the OS uses to throttle), with a
change notification. Linux only reports temperatures, so `LinuxThermalSource` maps each sensor to a level and
takes the hottest; the thresholds are below. A reading is never invented: no sensor means `unknown`.

Linux thresholds, per sensor (°C), first rule that applies:
- with a critical limit C (sysfs `critical`/`hot` trip point, psutil `critical`):
  critical at >= C - 5, serious at >= the passive limit P if there is one else C - 15, fair at >= that - 10;
- with only a passive limit P (sysfs `passive` trip point, psutil `high`): critical at >= P + 10, serious at
  >= P, fair at >= P - 10 — the kernel starts throttling at P, which is what macOS calls serious;
- with no limits: fair at >= 70, serious at >= 85, critical at >= 95 (typical laptop CPU package limits).
Readings <= 0 or above 150 are treated as absent: unpopulated sensors read 0 and broken ones read junk.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class ThermalState(enum.Enum):
    NOMINAL = "nominal"
    FAIR = "fair"
    SERIOUS = "serious"
    CRITICAL = "critical"
    UNKNOWN = "unknown"

    @property
    def severity(self) -> int:
        # Unknown ranks with nominal: with nothing measured the engine must not slow itself down.
        return {"unknown": 0, "nominal": 0, "fair": 1, "serious": 2, "critical": 3}[self.value]


@dataclass(frozen=True)
class ThermalReading:
    state: ThermalState
    source: str  # where the state came from, e.g. "NSProcessInfo", "sysfs", "psutil", or why there is none
    celsius: float | None = None  # the deciding sensor's temperature (Linux); macOS exposes none
    sensor: str | None = None


class ThermalSource(Protocol):
    def read(self) -> ThermalReading: ...


class ThermalNotifier(Protocol):
    """A source that can also push changes (macOS); `subscribe` returns a function that unsubscribes."""

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]: ...


class NullThermalSource:
    """For platforms with no thermal source: always `unknown`, with the reason."""

    def __init__(self, why: str = "no thermal source on this platform") -> None:
        self.why = why

    def read(self) -> ThermalReading:
        return ThermalReading(ThermalState.UNKNOWN, self.why)


# --- Linux -------------------------------------------------------------------------------------------------------

ABSOLUTE_C = {ThermalState.FAIR: 70.0, ThermalState.SERIOUS: 85.0, ThermalState.CRITICAL: 95.0}
_PLAUSIBLE_C = (0.0, 150.0)


def _plausible(c: float | None) -> float | None:
    return c if c is not None and _PLAUSIBLE_C[0] < c <= _PLAUSIBLE_C[1] else None


def classify(celsius: float, passive: float | None = None, critical: float | None = None) -> ThermalState:
    """Map one temperature to a level using the sensor's own limits when it has them (see module doc)."""
    passive, critical = _plausible(passive), _plausible(critical)
    if critical is not None:
        serious_at = passive if passive is not None and passive < critical - 5 else critical - 15
        limits = (critical - 5, serious_at, serious_at - 10)
    elif passive is not None:
        limits = (passive + 10, passive, passive - 10)
    else:
        limits = (ABSOLUTE_C[ThermalState.CRITICAL], ABSOLUTE_C[ThermalState.SERIOUS], ABSOLUTE_C[ThermalState.FAIR])
    for state, at in zip((ThermalState.CRITICAL, ThermalState.SERIOUS, ThermalState.FAIR), limits, strict=True):
        if celsius >= at:
            return state
    return ThermalState.NOMINAL


def _read_text(path: Path) -> str:
    # sysfs files can refuse reads (EIO, ENODATA) while a device sleeps: treat them as absent, never as zero.
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _read_millic(path: Path) -> float | None:
    text = _read_text(path)
    return int(text) / 1000.0 if text.lstrip("-").isdigit() else None


@dataclass(frozen=True)
class SensorReading:
    name: str
    celsius: float
    passive: float | None
    critical: float | None

    @property
    def state(self) -> ThermalState:
        return classify(self.celsius, self.passive, self.critical)


def read_thermal_zones(root: Path) -> list[SensorReading]:
    """Parse `<root>/sys/class/thermal/thermal_zone*/{type,temp,trip_point_N_temp,trip_point_N_type}`."""
    readings = []
    for zone in sorted((root / "sys/class/thermal").glob("thermal_zone*")):
        celsius = _plausible(_read_millic(zone / "temp"))
        if celsius is None:
            continue
        passive: float | None = None
        critical: float | None = None
        for trip in zone.glob("trip_point_*_type"):
            kind = _read_text(trip)
            value = _plausible(_read_millic(trip.with_name(trip.name.replace("_type", "_temp"))))
            if value is None:
                continue
            # The lowest limit of each kind is the one reached first.
            if kind == "passive":
                passive = value if passive is None else min(passive, value)
            elif kind in ("critical", "hot"):
                critical = value if critical is None else min(critical, value)
        name = _read_text(zone / "type") or zone.name
        readings.append(SensorReading(f"{zone.name} ({name})", celsius, passive, critical))
    return readings


def read_psutil_sensors(sensors: Mapping[str, Sequence[Any]]) -> list[SensorReading]:
    """Parse `psutil.sensors_temperatures()`: name -> [shwtemp(label, current, high, critical)]."""
    readings = []
    for chip, entries in sensors.items():
        for entry in entries:
            celsius = _plausible(entry.current)
            if celsius is not None:
                label = f"{chip}/{entry.label}" if entry.label else chip
                readings.append(SensorReading(label, celsius, entry.high, entry.critical))
    return readings


def _psutil_sensors() -> Mapping[str, Sequence[Any]]:
    import psutil

    return psutil.sensors_temperatures() if hasattr(psutil, "sensors_temperatures") else {}


class LinuxThermalSource:
    """Hottest of the sysfs thermal zones under `root` and psutil's hwmon sensors, mapped to a level."""

    def __init__(
        self, root: Path = Path("/"), sensors: Callable[[], Mapping[str, Sequence[Any]]] = _psutil_sensors
    ) -> None:
        self.root = Path(root)
        self.sensors = sensors

    def read(self) -> ThermalReading:
        candidates = [("sysfs", r) for r in read_thermal_zones(self.root)]
        with contextlib.suppress(OSError):  # hwmon files can vanish or refuse reads mid-scan; sysfs zones still count
            candidates += [("psutil", r) for r in read_psutil_sensors(self.sensors())]
        if not candidates:
            return ThermalReading(ThermalState.UNKNOWN, "no temperature sensors found")
        source, worst = max(candidates, key=lambda c: (c[1].state.severity, c[1].celsius))
        return ThermalReading(worst.state, source, worst.celsius, worst.name)


# --- macOS -------------------------------------------------------------------------------------------------------

# NSProcessInfoThermalState raw values (Foundation/NSProcessInfo.h).
_NS_STATES = {0: ThermalState.NOMINAL, 1: ThermalState.FAIR, 2: ThermalState.SERIOUS, 3: ThermalState.CRITICAL}
_NOTIFICATION = "NSProcessInfoThermalStateDidChangeNotification"


class MacThermalSource:
    """`NSProcessInfo.processInfo().thermalState()` through pyobjc, imported on first use (macOS only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._observers: list[Any] = []

    def read(self) -> ThermalReading:
        try:
            from Foundation import NSProcessInfo
        except ImportError as exc:
            return ThermalReading(ThermalState.UNKNOWN, f"pyobjc Foundation is not importable ({exc})")
        raw = int(NSProcessInfo.processInfo().thermalState())
        return ThermalReading(_NS_STATES.get(raw, ThermalState.UNKNOWN), "NSProcessInfo")

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (on the posting thread) whenever macOS changes the thermal state."""
        try:
            import Foundation
        except ImportError:
            return lambda: None  # nothing will ever post; the policy's polling still sees `unknown`
        name = getattr(Foundation, _NOTIFICATION, _NOTIFICATION)
        center = Foundation.NSNotificationCenter.defaultCenter()
        # queue=None: run the block synchronously on whichever thread posts, so no run loop of ours is needed.
        token = center.addObserverForName_object_queue_usingBlock_(name, None, None, lambda _note: callback())
        with self._lock:
            self._observers.append(token)

        def unsubscribe() -> None:
            with self._lock:
                if token in self._observers:
                    self._observers.remove(token)
                    center.removeObserver_(token)

        return unsubscribe


def default_thermal_source(platform: str | None = None) -> ThermalSource:
    import sys

    platform = platform or sys.platform
    if platform == "darwin":
        return MacThermalSource()
    if platform.startswith("linux"):
        return LinuxThermalSource()
    return NullThermalSource(f"no thermal source on {platform}")
