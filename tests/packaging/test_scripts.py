"""The macOS-only scripts parse, and off-Mac they stop with one clear line instead of half-running."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from tests.packaging.loader import PACKAGING

SCRIPTS = ["sign.sh", "notarize.sh", "make_dmg.sh"]


@pytest.mark.parametrize("name", [*SCRIPTS, "common.sh"])
def test_bash_syntax(name: str) -> None:
    subprocess.run(["bash", "-n", str(PACKAGING / name)], check=True)


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the refusal on other platforms")
@pytest.mark.parametrize("name", SCRIPTS)
def test_refuses_off_mac(name: str) -> None:
    r = subprocess.run(["bash", str(PACKAGING / name)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"{name}: needs macOS (this is {platform.system()}); nothing was done."]
    assert r.stdout == ""
