"""Hardware awareness: chip, thermal state and memory behind small source protocols, and the policy that adapts
generation to them. `this_machine_policy` wires the real sources; tests build `HardwarePolicy` from fakes.
"""

from __future__ import annotations

from engine.hw.chip import ChipInfo, ChipSource, default_chip_source, recommended_threads
from engine.hw.memory import (
    MemoryPressure,
    MemorySnapshot,
    MemorySource,
    SystemMemorySource,
    format_bytes,
    snapshot_cost_s,
)
from engine.hw.policy import DecisionKind, HardwarePolicy, Mode, PolicyConfig, PolicyDecision, PolicyState
from engine.hw.thermal import ThermalReading, ThermalSource, ThermalState, default_thermal_source


def use_recommended_threads(threads: int | None = None) -> int:
    """Set torch's intra-op thread count (`threads`, else the recommendation for this machine); returns it."""
    import torch

    n = threads or recommended_threads(default_chip_source().read())
    torch.set_num_threads(n)
    return n


def this_machine_policy(mode: Mode = Mode.BALANCED, config: PolicyConfig | None = None) -> HardwarePolicy:
    return HardwarePolicy(default_thermal_source(), SystemMemorySource(), mode, config)


__all__ = [
    "ChipInfo",
    "ChipSource",
    "DecisionKind",
    "HardwarePolicy",
    "MemoryPressure",
    "MemorySnapshot",
    "MemorySource",
    "Mode",
    "PolicyConfig",
    "PolicyDecision",
    "PolicyState",
    "SystemMemorySource",
    "ThermalReading",
    "ThermalSource",
    "ThermalState",
    "default_chip_source",
    "default_thermal_source",
    "format_bytes",
    "recommended_threads",
    "snapshot_cost_s",
    "this_machine_policy",
    "use_recommended_threads",
]
