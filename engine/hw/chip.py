"""What machine this is: CPU/chip name, core counts, total memory. Read once; none of it changes while running."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.hw import sysctl


@dataclass(frozen=True)
class ChipInfo:
    name: str  # "Apple M3 Pro", "AMD Ryzen 7 7840U w/ Radeon 780M Graphics", ...
    system: str  # platform.system(): Darwin, Linux
    machine: str  # platform.machine(): arm64, x86_64
    cores: int | None  # logical CPUs
    performance_cores: int | None  # Apple Silicon only (hw.perflevel0)
    efficiency_cores: int | None  # Apple Silicon only (hw.perflevel1)
    total_memory_bytes: int | None


class ChipSource(Protocol):
    def read(self) -> ChipInfo: ...


class MacChipSource:
    """sysctl: machdep.cpu.brand_string, hw.perflevel{0,1}.physicalcpu, hw.logicalcpu, hw.memsize."""

    def __init__(
        self,
        sysctl_str: Callable[[str], str | None] = sysctl.sysctl_str,
        sysctl_int: Callable[[str], int | None] = sysctl.sysctl_int,
    ) -> None:
        self.sysctl_str = sysctl_str
        self.sysctl_int = sysctl_int

    def read(self) -> ChipInfo:
        return ChipInfo(
            name=self.sysctl_str("machdep.cpu.brand_string") or platform.processor() or "unknown Mac",
            system="Darwin",
            machine=platform.machine(),
            cores=self.sysctl_int("hw.logicalcpu") or os.cpu_count(),
            # Intel Macs have no perflevels: None, not a guess.
            performance_cores=self.sysctl_int("hw.perflevel0.physicalcpu"),
            efficiency_cores=self.sysctl_int("hw.perflevel1.physicalcpu"),
            total_memory_bytes=self.sysctl_int("hw.memsize"),
        )


def _first_field(text: str, keys: tuple[str, ...]) -> str | None:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            fields.setdefault(key.strip(), value.strip())
    return next((fields[k] for k in keys if k in fields), None)


class LinuxChipSource:
    """/proc/cpuinfo's model name and /proc/meminfo's MemTotal under `root`, os.cpu_count()."""

    # x86 has "model name"; many ARM kernels only "Hardware" or "Model" (e.g. Raspberry Pi).
    NAME_KEYS = ("model name", "Hardware", "Model", "cpu model")

    def __init__(self, root: Path = Path("/"), cpu_count: Callable[[], int | None] = os.cpu_count) -> None:
        self.root = Path(root)
        self.cpu_count = cpu_count

    def _read(self, rel: str) -> str:
        try:
            return (self.root / rel).read_text(errors="replace")
        except OSError:
            return ""

    def read(self) -> ChipInfo:
        name = _first_field(self._read("proc/cpuinfo"), self.NAME_KEYS)
        mem_total = _first_field(self._read("proc/meminfo"), ("MemTotal",))
        total = None
        if mem_total and mem_total.split()[0].isdigit():
            total = int(mem_total.split()[0]) * 1024  # /proc/meminfo counts kB (KiB)
        return ChipInfo(
            name=name or platform.processor() or platform.machine() or "unknown CPU",
            system="Linux",
            machine=platform.machine(),
            cores=self.cpu_count(),
            performance_cores=None,
            efficiency_cores=None,
            total_memory_bytes=total,
        )


class GenericChipSource:
    """Other platforms: what the standard library knows."""

    def read(self) -> ChipInfo:
        import psutil

        return ChipInfo(
            platform.processor() or platform.machine() or "unknown CPU",
            platform.system(),
            platform.machine(),
            os.cpu_count(),
            None,
            None,
            psutil.virtual_memory().total,
        )


def recommended_threads(chip: ChipInfo) -> int:
    """Intra-op threads for CPU inference. Apple Silicon: the performance cores (a parallel op waits for its
    slowest worker, so efficiency cores slow it down). Elsewhere: every core but one. OpenMP workers spin while they
    wait; with no core left over, the app's GUI thread and the OS preempt them and every op stalls (measured on a
    2-core machine: 3 tokens/s with 2 threads under a GUI, 124 with 1)."""
    if chip.performance_cores:
        return chip.performance_cores
    return max(1, (chip.cores or 1) - 1)


def default_chip_source(platform_name: str | None = None) -> ChipSource:
    platform_name = platform_name or sys.platform
    if platform_name == "darwin":
        return MacChipSource()
    if platform_name.startswith("linux"):
        return LinuxChipSource()
    return GenericChipSource()
