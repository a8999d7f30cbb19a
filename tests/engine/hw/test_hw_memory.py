from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from engine.hw.memory import (
    LinuxPressure,
    MacPressure,
    MemoryPressure,
    MemorySnapshot,
    SystemMemorySource,
    code_ranges,
    format_bytes,
    parse_psi,
    parse_smaps,
    pressure_from_available,
    read_device_memory,
    release_code_pages,
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


SMAPS = """\
7f0000000000-7f0000100000 r-xp 00000000 08:01 11 /usr/lib/libcode.so
Size:               1024 kB
Rss:                 400 kB
Anonymous:             0 kB
7f0000100000-7f0000200000 r-xp 00100000 08:01 12 /usr/lib/libpatched.so
Rss:                 300 kB
Anonymous:             8 kB
7f0000200000-7f0000300000 r--p 00000000 08:01 11 /usr/lib/libcode.so
Rss:                 200 kB
Anonymous:             0 kB
7f0000300000-7f0000400000 rw-p 00000000 08:01 11 /usr/lib/libcode.so
Rss:                 100 kB
Anonymous:             0 kB
7f0000400000-7f0000500000 r-xp 00000000 00:00 0 [vdso]
Rss:                   4 kB
Anonymous:             0 kB
7f0000500000-7f0000600000 r-xp 00000000 00:00 0
Rss:                  64 kB
Anonymous:             0 kB
7f0000600000-7f0000700000 r-xp 00000000 08:01 13 /opt/a dir/libspaced.so
Rss:                  12 kB
Anonymous:             0 kB
7f0000700000-7f0000800000 r-xp 00000000 08:01 14 /usr/lib/libcold.so
Rss:                   0 kB
Anonymous:             0 kB
7f0000800000-7f0000900000 r-xp 00000000 08:01 15 /usr/lib/libodd.so
Rss:                  16 kB
Anonymous:           ??? kB
7f0000900000-7f0000a00000 r-xp 00000000 08:01 16 /usr/lib/libswapped.so
Rss:                  20 kB
Anonymous:             0 kB
Swap:                  4 kB
"""


def test_only_clean_file_backed_code_is_given_back() -> None:
    # Code pages a process wrote (Anonymous > 0, or swapped out), data, writable, anonymous and special mappings,
    # and a mapping whose private pages cannot be read are all left alone: only pages equal to their file's bytes
    # qualify.
    assert code_ranges(parse_smaps(SMAPS)) == [
        (0x7F0000000000, 0x7F0000100000, 400 * 1024),
        (0x7F0000600000, 0x7F0000700000, 12 * 1024),
    ]


RELEASE_IN_A_FRESH_PROCESS = """
import json
import torch
from engine.hw.memory import code_ranges, own_mappings, release_code_pages
def resident():
    return sum(rss for _, _, rss in code_ranges(own_mappings()))
before = resident()
released = release_code_pages()
after = resident()
print(json.dumps([before, released, after, float(torch.arange(5.0).square().sum())]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc/self/smaps and MADV_DONTNEED")
def test_released_code_pages_leave_the_process_and_it_runs_on() -> None:
    # A fresh process, so what earlier tests released or touched does not count: torch's import alone leaves tens
    # of MB of code resident.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    out = subprocess.run(
        [sys.executable, "-c", RELEASE_IN_A_FRESH_PROCESS], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    before, released, after, computed = json.loads(out.stdout)
    assert before > 20 * 2**20 and released > before // 2
    assert after < before // 4  # what ran since (the smaps read, the sum) faulted back in; the rest stayed out
    assert computed == 30.0  # torch's code comes back as it runs


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc/self/smaps and MADV_DONTNEED")
def test_a_code_mapping_the_process_wrote_keeps_its_bytes(tmp_path: Path) -> None:
    # A private mapping whose pages were written, then made executable (as a loader relocating code would): its
    # pages differ from the file's, so giving them back would lose them. They must survive a release.
    path = tmp_path / "code.bin"
    path.write_bytes(bytes(mmap.PAGESIZE * 4))
    with path.open("r+b") as f:
        mapped = mmap.mmap(f.fileno(), mmap.PAGESIZE * 4, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mapped[:5] = b"spark"
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(address, mmap.PAGESIZE * 4, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        pytest.skip("this file system does not allow executable mappings")
    try:
        release_code_pages()
        assert ctypes.string_at(address, 5) == b"spark"
    finally:
        libc.mprotect(address, mmap.PAGESIZE * 4, mmap.PROT_READ | mmap.PROT_WRITE)
