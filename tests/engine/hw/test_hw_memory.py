from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest

from engine.hw.memory import (
    LinuxPressure,
    MacPressure,
    MemoryPressure,
    MemorySnapshot,
    SystemMemorySource,
    format_bytes,
    parse_psi,
    pressure_from_available,
    read_device_memory,
    snapshot_cost_s,
)

# The shape (fields used) of psutil.virtual_memory().
svmem = namedtuple("svmem", ["total", "available", "percent", "used", "free"])
GB = 2**30


def psi_text(some: float, full: float) -> str:
    return (
        f"some avg10={some:.2f} avg60=1.00 avg300=0.50 total=123456\n"
        f"full avg10={full:.2f} avg60=0.20 avg300=0.10 total=2345\n"
    )


def psi_tree(root: Path, text: str) -> Path:
    (root / "proc/pressure").mkdir(parents=True)
    (root / "proc/pressure/memory").write_text(text)
    return root


@pytest.mark.parametrize(
    ("some", "full", "expected"),
    [
        (0.0, 0.0, "normal"),
        (9.99, 0.0, "normal"),
        (10.0, 0.0, "warning"),
        (40.0, 9.0, "warning"),
        (40.0, 10.0, "critical"),
    ],
)
def test_psi_levels(some: float, full: float, expected: str) -> None:
    assert parse_psi(psi_text(some, full)).value == expected


def test_psi_unparseable_is_unknown() -> None:
    assert parse_psi("") is MemoryPressure.UNKNOWN


def test_pressure_from_available_ratio() -> None:
    assert pressure_from_available(16 * GB, 8 * GB) is MemoryPressure.NORMAL
    assert pressure_from_available(100, 9) is MemoryPressure.WARNING
    assert pressure_from_available(100, 4) is MemoryPressure.CRITICAL
    assert pressure_from_available(0, 0) is MemoryPressure.UNKNOWN


def test_linux_pressure_takes_the_worse_of_psi_and_availability(tmp_path: Path) -> None:
    reader = LinuxPressure(psi_tree(tmp_path, psi_text(12.0, 0.0)))
    assert reader.read(16 * GB, 8 * GB) is MemoryPressure.WARNING  # PSI says so
    assert reader.read(100, 3) is MemoryPressure.CRITICAL  # availability says worse


def test_linux_pressure_without_psi_uses_availability(tmp_path: Path) -> None:
    reader = LinuxPressure(tmp_path)
    assert reader.read(100, 50) is MemoryPressure.NORMAL
    assert reader.read(100, 8) is MemoryPressure.WARNING


def test_mac_pressure_from_kernel_level() -> None:
    for level, expected in ((1, "normal"), (2, "warning"), (4, "critical")):
        assert MacPressure(lambda _k, level=level: level).read(100, 1).value == expected
    assert MacPressure(lambda _k: None).read(100, 50) is MemoryPressure.NORMAL  # no sysctl: availability


def test_snapshot_from_psutil_shaped_fakes() -> None:
    source = SystemMemorySource(
        virtual_memory=lambda: svmem(16 * GB, 6 * GB, 62.5, 10 * GB, 1 * GB),
        rss=lambda: 900 * 2**20,
        pressure=MacPressure(lambda _k: 2),
        device=lambda backend: None,
    )
    tiers = {"working": 1, "episodic": 2, "persistent": 3}
    source.attach_model(2 * GB, lambda: tiers, backend="mps")
    snap = source.snapshot()
    assert snap == MemorySnapshot(900 * 2**20, 16 * GB, 6 * GB, MemoryPressure.WARNING, None, 2 * GB, tiers)


def test_snapshot_reads_device_memory_of_the_backend_in_use() -> None:
    seen: list[str | None] = []

    def device(backend: str | None) -> None:
        seen.append(backend)

    source = SystemMemorySource(rss=lambda: 1, device=device)
    source.snapshot()
    source.attach_model(1, backend="cuda")
    source.snapshot()
    assert seen == [None, "cuda"]


def test_real_snapshot_and_its_cost_are_measurable() -> None:
    source = SystemMemorySource()
    snap = source.snapshot()
    assert snap.rss_bytes > 0 and 0 < snap.available_bytes <= snap.total_bytes
    assert snapshot_cost_s(source, repeat=20) > 0  # the figure is reported, never asserted against a clock


def test_device_memory_is_none_without_an_accelerator_in_use() -> None:
    assert read_device_memory("cpu") is None
    assert read_device_memory("coreml") is None
    import torch

    if not (torch.cuda.is_available() or torch.backends.mps.is_available()):
        assert read_device_memory(None) is None


def test_format_bytes() -> None:
    assert format_bytes(16 * GB) == "16.0 GB"
    assert format_bytes(640 * 2**20) == "640.0 MB"
    assert format_bytes(512) == "512 B"
