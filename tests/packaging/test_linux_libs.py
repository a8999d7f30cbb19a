"""`make run` on Linux first checks the system libraries Qt's xcb plugin loads, and names the packages to install."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _check(tmp_path: Path, listed: list[str], platform: str = "xcb") -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "ldconfig"
    lines = "".join(f"\t{lib} (libc6,x86-64) => /lib/x86_64-linux-gnu/{lib}\\n" for lib in listed)
    fake.write_text(f'#!/bin/sh\nprintf "{lines}"\n')
    fake.chmod(0o755)
    return subprocess.run(
        ["make", "-s", "-C", str(ROOT), "linux-libs", f"LDCONFIG={fake}", f"QT_QPA_PLATFORM={platform}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("make") is None, reason="Linux, make")
def test_missing_xcb_libraries_are_named_with_their_packages(tmp_path: Path) -> None:
    r = _check(tmp_path, ["libxcb-cursor.so.0", "libxcb-image.so.0"])
    assert r.returncode != 0
    install = next(line for line in r.stdout.splitlines() if "apt-get install" in line)
    assert "libxcb-icccm4" in install and "libxcb-keysyms1" in install and "libxcb-cursor0" not in install
    everything = [
        "libxcb-cursor.so.0",
        "libxcb-icccm.so.4",
        "libxcb-keysyms.so.1",
        "libxcb-image.so.0",
        "libxcb-render-util.so.0",
        "libxcb-shape.so.0",
        "libxcb-randr.so.0",
        "libxcb-xkb.so.1",
        "libxkbcommon-x11.so.0",
    ]
    assert _check(tmp_path, everything).returncode == 0
    assert _check(tmp_path, [], platform="offscreen").returncode == 0  # no window, no check
