"""Memory: process RSS, system total/available and pressure, device memory, model and cascade bytes.

A snapshot is taken between tokens, so it must stay cheap (tens of microseconds): psutil's direct reads, one small
/proc file or one sysctl, and device counters only when torch is already loaded. `snapshot_cost_s` measures it.

Pressure levels mirror macOS's own (normal / warning / critical). Where the kernel gives no level:
- Linux PSI (`/proc/pressure/memory`): warning when some task stalled on memory >= 10 % of the last 10 s
  (`some avg10`), critical when every task did >= 10 % (`full avg10`);
- from availability: warning below 10 % of RAM available, critical below 5 %.
Linux takes the worse of the two: PSI sees stalls already happening, the availability ratio sees them coming.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from engine.hw import sysctl


class MemoryPressure(enum.Enum):
    NORMAL = "normal"
    WARNING = "warning"
    CRITICAL = "critical"
    UNKNOWN = "unknown"

    @property
    def severity(self) -> int:
        return {"unknown": 0, "normal": 0, "warning": 1, "critical": 2}[self.value]


AVAILABLE_WARNING = 0.10  # share of RAM available below which pressure is `warning`
AVAILABLE_CRITICAL = 0.05
PSI_SOME_WARNING = 10.0  # percent of the last 10 s
PSI_FULL_CRITICAL = 10.0


def pressure_from_available(total: int, available: int) -> MemoryPressure:
    if total <= 0:
        return MemoryPressure.UNKNOWN
    share = available / total
    if share < AVAILABLE_CRITICAL:
        return MemoryPressure.CRITICAL
    if share < AVAILABLE_WARNING:
        return MemoryPressure.WARNING
    return MemoryPressure.NORMAL


def parse_psi(text: str) -> MemoryPressure:
    """`some avg10=1.00 avg60=... total=...` / `full avg10=...` -> level (UNKNOWN when unparseable)."""
    avg10: dict[str, float] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        for pair in rest.split():
            key, _, value = pair.partition("=")
            if key == "avg10":
                with contextlib.suppress(ValueError):
                    avg10[kind] = float(value)
    if "some" not in avg10:
        return MemoryPressure.UNKNOWN
    if avg10.get("full", 0.0) >= PSI_FULL_CRITICAL:
        return MemoryPressure.CRITICAL
    if avg10["some"] >= PSI_SOME_WARNING:
        return MemoryPressure.WARNING
    return MemoryPressure.NORMAL


class PressureReader(Protocol):
    def read(self, total: int, available: int) -> MemoryPressure: ...


class LinuxPressure:
    """Worse of PSI (`<root>/proc/pressure/memory`, when the kernel has it) and the availability ratio."""

    def __init__(self, root: Path = Path("/")) -> None:
        self.path = Path(root) / "proc/pressure/memory"

    def read(self, total: int, available: int) -> MemoryPressure:
        ratio = pressure_from_available(total, available)
        try:
            psi = parse_psi(self.path.read_text())
        except OSError:  # no PSI (kernel < 4.20, or disabled): the ratio alone
            return ratio
        return max(psi, ratio, key=lambda p: p.severity)


# kern.memorystatus_vm_pressure_level values (xnu's kVMPressure* levels).
_MAC_LEVELS = {1: MemoryPressure.NORMAL, 2: MemoryPressure.WARNING, 4: MemoryPressure.CRITICAL}


class MacPressure:
    """The kernel's own level (what `memory_pressure` and Activity Monitor show), via sysctl."""

    def __init__(self, sysctl_int: Callable[[str], int | None] = sysctl.sysctl_int) -> None:
        self.sysctl_int = sysctl_int

    def read(self, total: int, available: int) -> MemoryPressure:
        level = self.sysctl_int("kern.memorystatus_vm_pressure_level")
        if level in _MAC_LEVELS:
            return _MAC_LEVELS[level]
        return pressure_from_available(total, available)


class RatioPressure:
    def read(self, total: int, available: int) -> MemoryPressure:
        return pressure_from_available(total, available)


@dataclass(frozen=True)
class DeviceMemory:
    backend: str  # "cuda" | "mps"
    allocated_bytes: int  # tensors alive
    reserved_bytes: int  # held from the driver: cuda's caching allocator, mps driver_allocated_memory


def read_device_memory(backend: str | None = None) -> DeviceMemory | None:
    """Device counters for `backend` (or whichever accelerator this process already uses), else None.

    torch is only consulted if something already imported it: a process that never loaded torch holds no device
    memory, and importing it here would cost seconds. CUDA is read only once initialised, so a snapshot never
    creates a CUDA context.
    """
    torch: Any = sys.modules.get("torch")
    if torch is None or backend in ("cpu", "coreml"):
        return None
    if backend in (None, "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        return DeviceMemory("cuda", int(torch.cuda.memory_allocated()), int(torch.cuda.memory_reserved()))
    if backend in (None, "mps") and torch.backends.mps.is_available():
        return DeviceMemory("mps", int(torch.mps.current_allocated_memory()), int(torch.mps.driver_allocated_memory()))
    return None


@dataclass(frozen=True)
class MemorySnapshot:
    rss_bytes: int
    total_bytes: int
    available_bytes: int
    pressure: MemoryPressure
    device: DeviceMemory | None = None
    weight_bytes: int = 0  # the loaded model's weights, as reported by the caller
    cascade_bytes: Mapping[str, int] = field(default_factory=dict)  # tier -> bytes, as reported by the caller


class MemorySource(Protocol):
    def snapshot(self) -> MemorySnapshot: ...


def _default_pressure() -> PressureReader:
    platform: str = sys.platform  # a plain str: the type checker would otherwise check one platform's branch only
    if platform == "darwin":
        return MacPressure()
    if platform.startswith("linux"):
        return LinuxPressure()
    return RatioPressure()


class SystemMemorySource:
    """psutil for RSS and system memory, a platform pressure reader, device counters, and caller-reported usage."""

    def __init__(
        self,
        *,
        virtual_memory: Callable[[], Any] = psutil.virtual_memory,
        rss: Callable[[], int] | None = None,
        pressure: PressureReader | None = None,
        device: Callable[[str | None], DeviceMemory | None] = read_device_memory,
        device_backend: str | None = None,
    ) -> None:
        self.virtual_memory = virtual_memory
        self.rss = rss or self._process_rss()
        self.pressure = pressure or _default_pressure()
        self.device = device
        self.device_backend = device_backend
        self.weight_bytes = 0
        self.cascade_bytes: Callable[[], Mapping[str, int]] = dict

    @staticmethod
    def _process_rss() -> Callable[[], int]:
        process = psutil.Process()  # created once: constructing one per snapshot would dominate its cost
        return lambda: int(process.memory_info().rss)

    def attach_model(
        self, weight_bytes: int, cascade_bytes: Callable[[], Mapping[str, int]] = dict, backend: str | None = None
    ) -> None:
        """Report the loaded model: its weight bytes, a function giving the cascade's bytes per tier, its backend."""
        self.weight_bytes = weight_bytes
        self.cascade_bytes = cascade_bytes
        self.device_backend = backend

    def snapshot(self) -> MemorySnapshot:
        vm = self.virtual_memory()
        total, available = int(vm.total), int(vm.available)
        return MemorySnapshot(
            rss_bytes=self.rss(),
            total_bytes=total,
            available_bytes=available,
            pressure=self.pressure.read(total, available),
            device=self.device(self.device_backend),
            weight_bytes=self.weight_bytes,
            cascade_bytes=dict(self.cascade_bytes()),
        )


def snapshot_cost_s(source: MemorySource, repeat: int = 2000) -> float:
    """Mean seconds per `source.snapshot()` over `repeat` calls, after a warm-up (a micro-benchmark)."""
    for _ in range(min(50, repeat)):
        source.snapshot()
    t0 = time.perf_counter()
    for _ in range(repeat):
        source.snapshot()
    return (time.perf_counter() - t0) / repeat


def format_bytes(n: int) -> str:
    """Human units for messages: "1.5 GB", "640 MB".

    Powers of 1024 under the usual labels, as macOS shows memory: a 16 GB Mac then reads "16.0 GB", not "17.2 GB".
    """
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


_SMAPS_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+ *(.*)$")
MADV_DONTNEED = 4  # Linux's value (asm-generic/mman-common.h)


@dataclass(frozen=True)
class MappedRange:
    """One mapping of a process, as /proc/<pid>/smaps lists it."""

    start: int
    end: int
    perms: str  # "r-xp": readable, not writable, executable, private
    path: str  # the mapped file, a "[tag]" (heap, stack, vdso), or "" (anonymous)
    sizes: dict[str, int | None]  # each "<key>: <n> kB" line in bytes ("Rss", "Anonymous", ...); None if unreadable


def parse_smaps(text: str) -> list[MappedRange]:
    """The mappings /proc/<pid>/smaps lists, in its order."""
    mappings: list[MappedRange] = []
    for line in text.splitlines():
        header = _SMAPS_HEADER.match(line)
        if header:
            start, end, perms, path = header.groups()
            mappings.append(MappedRange(int(start, 16), int(end, 16), perms, path, {}))
        elif mappings:
            key, _, value = line.partition(":")
            words = value.split()
            if words and words[-1] == "kB":
                mappings[-1].sizes[key] = int(words[0]) * 1024 if words[0].isdigit() else None
    return mappings


def own_mappings() -> list[MappedRange]:
    """This process's mappings (Linux; OSError elsewhere)."""
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        return parse_smaps(f.read())


def code_ranges(mappings: list[MappedRange]) -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of each mapping that holds only a file's own code: private, readable,
    executable, not writable, file-backed, and with no anonymous (copy-on-write) page in memory or in swap, so every
    resident page of it is the file's own bytes, read back if it is touched again. An unreadable count is taken for
    a written page: the mapping is left be."""
    return [
        (m.start, m.end, m.sizes.get("Rss") or 0)
        for m in mappings
        if m.perms == "r-xp"
        and m.path.startswith("/")
        and all(m.sizes.get(key, 0) == 0 for key in ("Anonymous", "Swap"))
        and m.sizes.get("Rss")
    ]


def release_code_pages() -> int:
    """Give the page cache back the pages of code the process has touched (Linux; elsewhere a no-op), and return
    their bytes. Importing torch runs every operator's registration once, touching ~70 MB of its libraries' code
    that a running model never executes again; those clean, file-backed pages are counted in the RSS until the
    kernel needs the memory. Dropped, they stay in the page cache and fault back in, from memory, as code runs
    (macOS's memory footprint never counts such pages). Only mappings without a private page are touched
    (code_ranges): no page the process wrote is ever discarded."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        ranges = code_ranges(own_mappings())
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return sum(rss for start, end, rss in ranges if madvise(start, end - start, MADV_DONTNEED) == 0)


def allocatable_bytes(virtual_memory: Callable[[], Any] = psutil.virtual_memory) -> int:
    """What this process may still allocate: the system's available memory or, under an address-space limit
    (`ulimit -v`, RLIMIT_AS), what the limit leaves above the address space already mapped, whichever is less."""
    free = int(virtual_memory().available)
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            free = min(free, max(0, soft - int(psutil.Process().memory_info().vms)))
    except (ImportError, OSError, ValueError):  # no rlimits (Windows) or no process figures: available memory only
        pass
    return free
