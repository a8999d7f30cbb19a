from __future__ import annotations

from pathlib import Path

import pytest

from engine.hw.chip import LinuxChipSource, MacChipSource

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD Ryzen 7 7840U w/ Radeon 780M Graphics
cpu MHz\t\t: 400.000

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD Ryzen 7 7840U w/ Radeon 780M Graphics
"""

ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 108.00
CPU part\t: 0xd08

Hardware\t: BCM2835
Model\t\t: Raspberry Pi 4 Model B Rev 1.4
"""

MEMINFO = "MemTotal:       16318432 kB\nMemFree:         1024000 kB\nMemAvailable:    8000000 kB\n"


def proc_tree(root: Path, cpuinfo: str, meminfo: str | None = MEMINFO) -> Path:
    (root / "proc").mkdir(parents=True)
    (root / "proc/cpuinfo").write_text(cpuinfo)
    if meminfo is not None:
        (root / "proc/meminfo").write_text(meminfo)
    return root


def test_linux_chip_from_proc(tmp_path: Path) -> None:
    info = LinuxChipSource(proc_tree(tmp_path, X86_CPUINFO), cpu_count=lambda: 16).read()
    assert info.name == "AMD Ryzen 7 7840U w/ Radeon 780M Graphics"
    assert (info.system, info.cores, info.total_memory_bytes) == ("Linux", 16, 16318432 * 1024)
    assert info.performance_cores is None and info.efficiency_cores is None


def test_linux_arm_chip_uses_hardware_line(tmp_path: Path) -> None:
    info = LinuxChipSource(proc_tree(tmp_path, ARM_CPUINFO), cpu_count=lambda: 4).read()
    assert info.name == "BCM2835"


def test_linux_chip_without_proc_files_reports_none_not_a_guess(tmp_path: Path) -> None:
    info = LinuxChipSource(tmp_path, cpu_count=lambda: None).read()
    assert info.total_memory_bytes is None and info.cores is None
    assert info.name  # falls back to platform's own name for the CPU


def test_mac_chip_from_sysctl_values() -> None:
    values: dict[str, str | int] = {
        "machdep.cpu.brand_string": "Apple M3 Pro",
        "hw.logicalcpu": 12,
        "hw.perflevel0.physicalcpu": 6,
        "hw.perflevel1.physicalcpu": 6,
        "hw.memsize": 36 * 2**30,
    }
    source = MacChipSource(sysctl_str=lambda k: values.get(k), sysctl_int=lambda k: values.get(k))
    info = source.read()
    assert (info.name, info.cores, info.performance_cores, info.efficiency_cores) == ("Apple M3 Pro", 12, 6, 6)
    assert info.total_memory_bytes == 36 * 2**30


@pytest.mark.mac
def test_mac_chip_real_sysctl() -> None:
    info = MacChipSource().read()
    assert info.name.startswith("Apple M")
    assert info.performance_cores and info.performance_cores > 0
    assert info.total_memory_bytes and info.total_memory_bytes >= 8 * 2**30


def test_recommended_threads_leave_room_for_the_gui_and_skip_efficiency_cores() -> None:
    from engine.hw.chip import ChipInfo, recommended_threads

    def chip(cores: int | None, perf: int | None = None) -> ChipInfo:
        return ChipInfo("x", "Linux", "x86_64", cores, perf, None, None)

    assert recommended_threads(chip(2)) == 1
    assert recommended_threads(chip(16)) == 15
    assert recommended_threads(chip(1)) == 1 and recommended_threads(chip(None)) == 1
    assert recommended_threads(chip(12, perf=8)) == 8  # Apple Silicon: the performance cores
