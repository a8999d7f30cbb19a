"""`python -m engine …` run as a user runs it: a subprocess of this checkout, its persistent cache in a folder of the
test's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def engine_cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MLOT_SPARK_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
