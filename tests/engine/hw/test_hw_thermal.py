from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest

from engine.hw.thermal import (
    LinuxThermalSource,
    MacThermalSource,
    NullThermalSource,
    ThermalState,
    classify,
    default_thermal_source,
    read_psutil_sensors,
    read_thermal_zones,
)

# The shape psutil.sensors_temperatures() returns.
shwtemp = namedtuple("shwtemp", ["label", "current", "high", "critical"])

N, F, S, C = ThermalState.NOMINAL, ThermalState.FAIR, ThermalState.SERIOUS, ThermalState.CRITICAL


def make_zone(root: Path, index: int, kind: str, millic: int | str, trips: list[tuple[str, int]] = ()) -> None:
    zone = root / "sys/class/thermal" / f"thermal_zone{index}"
    zone.mkdir(parents=True)
    (zone / "type").write_text(kind + "\n")
    (zone / "temp").write_text(f"{millic}\n")
    (zone / "mode").write_text("enabled\n")
    for i, (trip_type, trip_millic) in enumerate(trips):
        (zone / f"trip_point_{i}_type").write_text(trip_type + "\n")
        (zone / f"trip_point_{i}_temp").write_text(f"{trip_millic}\n")
    # Real sysfs also holds cooling-device links and policy files the reader must ignore.
    (zone / "policy").write_text("step_wise\n")


def no_sensors() -> dict:
    return {}


@pytest.mark.parametrize(
    ("celsius", "passive", "critical", "expected"),
    [
        # critical trip 105, passive 90: fair from 80, serious from 90, critical from 100
        (60.0, 90.0, 105.0, N),
        (80.0, 90.0, 105.0, F),
        (90.0, 90.0, 105.0, S),
        (100.0, 90.0, 105.0, C),
        # critical only (100): serious from 85, fair from 75, critical from 95
        (74.9, None, 100.0, N),
        (75.0, None, 100.0, F),
        (85.0, None, 100.0, S),
        (95.0, None, 100.0, C),
        # passive only (80): fair from 70, serious from 80, critical from 90
        (69.0, 80.0, None, N),
        (70.0, 80.0, None, F),
        (80.0, 80.0, None, S),
        (90.0, 80.0, None, C),
        # no limits: absolute 70 / 85 / 95
        (50.0, None, None, N),
        (70.0, None, None, F),
        (85.0, None, None, S),
        (95.0, None, None, C),
        # a junk limit (0 or absurd) is ignored, falling back to the absolute thresholds
        (86.0, 0.0, 999.0, S),
    ],
)
def test_classify_thresholds(
    celsius: float, passive: float | None, critical: float | None, expected: ThermalState
) -> None:
    assert classify(celsius, passive, critical) is expected


def test_sysfs_zones_are_parsed_with_their_trip_points(tmp_path: Path) -> None:
    make_zone(tmp_path, 0, "acpitz", 45000, [("critical", 105000), ("passive", 95000)])
    make_zone(tmp_path, 1, "x86_pkg_temp", 91500, [("passive", 90000), ("critical", 100000)])
    make_zone(tmp_path, 2, "iwlwifi_1", 0)  # unpopulated sensor: ignored
    make_zone(tmp_path, 3, "broken", "N/A")  # unreadable: ignored
    readings = read_thermal_zones(tmp_path)
    assert [(r.name, r.celsius, r.passive, r.critical) for r in readings] == [
        ("thermal_zone0 (acpitz)", 45.0, 95.0, 105.0),
        ("thermal_zone1 (x86_pkg_temp)", 91.5, 90.0, 100.0),
    ]
    reading = LinuxThermalSource(tmp_path, no_sensors).read()
    assert (reading.state, reading.source, reading.celsius, reading.sensor) == (
        S,
        "sysfs",
        91.5,
        "thermal_zone1 (x86_pkg_temp)",
    )


def test_lowest_trip_of_a_kind_wins_and_hot_counts_as_critical(tmp_path: Path) -> None:
    make_zone(tmp_path, 0, "cpu", 93000, [("active", 60000), ("hot", 98000), ("critical", 110000)])
    assert LinuxThermalSource(tmp_path, no_sensors).read().state is C  # hot 98 -> critical from 93


def test_psutil_sensors_are_read_and_the_hottest_level_wins(tmp_path: Path) -> None:
    make_zone(tmp_path, 0, "acpitz", 50000, [("critical", 105000)])
    sensors = {
        "coretemp": [shwtemp("Package id 0", 82.0, 80.0, 100.0), shwtemp("Core 0", 60.0, 80.0, 100.0)],
        "nvme": [shwtemp("", 40.0, None, None)],
    }
    readings = read_psutil_sensors(sensors)
    assert [r.name for r in readings] == ["coretemp/Package id 0", "coretemp/Core 0", "nvme"]
    reading = LinuxThermalSource(tmp_path, lambda: sensors).read()
    assert (reading.state, reading.source, reading.sensor) == (S, "psutil", "coretemp/Package id 0")


def test_no_sensors_means_unknown_never_a_guess(tmp_path: Path) -> None:
    reading = LinuxThermalSource(tmp_path, no_sensors).read()
    assert reading.state is ThermalState.UNKNOWN and reading.celsius is None
    assert NullThermalSource().read().state is ThermalState.UNKNOWN
    assert default_thermal_source("win32").read().state is ThermalState.UNKNOWN


def test_unreadable_psutil_sensors_fall_back_to_sysfs(tmp_path: Path) -> None:
    make_zone(tmp_path, 0, "acpitz", 50000)

    def failing() -> dict:
        raise OSError("hwmon vanished")

    assert LinuxThermalSource(tmp_path, failing).read().state is N


def test_mac_source_without_pyobjc_reports_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "Foundation", None)  # makes `import Foundation` fail
    source = MacThermalSource()
    assert source.read().state is ThermalState.UNKNOWN
    source.subscribe(lambda: None)()  # subscribing is a harmless no-op


@pytest.mark.mac
def test_mac_thermal_state_and_notifications() -> None:
    from Foundation import NSNotificationCenter, NSProcessInfo

    source = MacThermalSource()
    reading = source.read()
    assert reading.state in (N, F, S, C) and reading.source == "NSProcessInfo"
    calls: list[int] = []
    unsubscribe = source.subscribe(lambda: calls.append(1))
    # Post the notification ourselves: the observer must fire without a run loop (queue=None).
    NSNotificationCenter.defaultCenter().postNotificationName_object_(
        "NSProcessInfoThermalStateDidChangeNotification", NSProcessInfo.processInfo()
    )
    assert calls == [1]
    unsubscribe()
    NSNotificationCenter.defaultCenter().postNotificationName_object_(
        "NSProcessInfoThermalStateDidChangeNotification", NSProcessInfo.processInfo()
    )
    assert calls == [1]
