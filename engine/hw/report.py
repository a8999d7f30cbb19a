"""The `python -m engine hw` report: one dict of plain values (docs/DESIGN.md, "Command-line contract") and its summary."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from engine.backends.base import BackendProbe
from engine.backends.mlx import mlx_device
from engine.hw.chip import ChipSource
from engine.hw.memory import MemorySource, format_bytes
from engine.hw.thermal import ThermalSource

# What each backend runs on, for the readable summary.
_BACKEND_HARDWARE = {
    "coreml": "Apple Neural Engine",
    "mlx": "MLX",
    "mps": "Apple GPU",
    "cuda": "NVIDIA GPU",
    "cpu": "CPU",
}


def _backend_entry(name: str, probe: BackendProbe) -> dict[str, Any]:
    entry: dict[str, Any] = {"available": probe.available, "reason": probe.reason}
    if name == "mlx":  # MLX runs on the Apple GPU or the CPU: which one, "gpu" | "cpu" (None: not installed)
        entry["device"] = mlx_device()
    return entry


def hardware_report(
    chip: ChipSource, thermal: ThermalSource, memory: MemorySource, probes: Callable[[], Mapping[str, BackendProbe]]
) -> dict[str, Any]:
    info = chip.read()
    reading = thermal.read()
    snap = memory.snapshot()
    return {
        "chip": info.name,
        "system": info.system,
        "machine": info.machine,
        "cores": info.cores,
        "performance_cores": info.performance_cores,
        "efficiency_cores": info.efficiency_cores,
        "thermal_state": reading.state.value,
        "thermal_source": reading.source,
        "temperature_c": reading.celsius,
        "rss_bytes": snap.rss_bytes,
        "available_bytes": snap.available_bytes,
        "total_bytes": snap.total_bytes,
        "memory_pressure": snap.pressure.value,
        "device_memory": asdict(snap.device) if snap.device else None,
        "backends": {name: _backend_entry(name, p) for name, p in probes().items()},
    }


def format_summary(report: Mapping[str, Any]) -> str:
    cores = f"{report['cores']} cores" if report["cores"] else "cores unknown"
    if report["performance_cores"] is not None:
        cores += f" ({report['performance_cores']} performance, {report['efficiency_cores'] or 0} efficiency)"
    thermal = report["thermal_state"]
    if report["temperature_c"] is not None:
        thermal += f" ({report['temperature_c']:.0f} °C)"
    lines = [
        f"chip:     {report['chip']} — {report['system']} {report['machine']}, {cores}",
        f"thermal:  {thermal} [{report['thermal_source']}]",
        f"memory:   {format_bytes(report['available_bytes'])} available of {format_bytes(report['total_bytes'])}, "
        f"pressure {report['memory_pressure']}; this process {format_bytes(report['rss_bytes'])}",
    ]
    device = report["device_memory"]
    if device:
        lines.append(
            f"device:   {device['backend']} {format_bytes(device['allocated_bytes'])} allocated, "
            f"{format_bytes(device['reserved_bytes'])} held"
        )
    lines.append("backends:")
    for name, probe in report["backends"].items():
        mark = "yes" if probe["available"] else "no "
        lines.append(f"  {mark} {name:<7} {_BACKEND_HARDWARE.get(name, '')}: {probe['reason']}")
    return "\n".join(lines)
