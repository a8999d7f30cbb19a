"""Build the app with PyInstaller and run the frozen binary (slow: minutes; `make test-packaging`, not CI).

Reuses dist/ when `make app` built it after the last change to any source it bundles; otherwise builds into a
temp dir. The build time and the output folder's size are printed in the test summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.packaging.loader import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

SPEC = REPO / "packaging" / "spark.spec"
IS_MAC = sys.platform == "darwin"
# Everything the spec reads or bundles: a build older than any of these is stale.
SOURCES = ["app", "engine", "coreml", "packaging", "resources", "pyproject.toml"]
BUILD_TIMEOUT_S = 3000
RUN_TIMEOUT_S = 900  # the self-test's own steps time out at 300 s each


@dataclass(frozen=True)
class Frozen:
    root: Path  # what a user gets: the .app on macOS, the one-folder directory elsewhere
    exe: Path
    internal: Path  # sys._MEIPASS of the frozen app: the collected packages and libraries

    @property
    def resources(self) -> Path:
        return self.internal / "resources"  # engine.paths.resources_dir() in the frozen app


def layout(dist: Path) -> Frozen:
    if IS_MAC:
        app = dist / "MLoT Spark.app"
        # PyInstaller puts data in Contents/Resources and links it into Contents/Frameworks (sys._MEIPASS).
        return Frozen(app, app / "Contents" / "MacOS" / "MLoT Spark", app / "Contents" / "Frameworks")
    folder = dist / "mlot-spark"
    return Frozen(folder, folder / "mlot-spark", folder / "_internal")


def newest_source_mtime() -> float:
    newest = 0.0
    for name in SOURCES:
        path = REPO / name
        files = (
            [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        )
        newest = max([newest, *(f.stat().st_mtime for f in files)])
    return newest


def du(path: Path) -> str:
    return subprocess.run(["du", "-sh", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]


def say(request: pytest.FixtureRequest, line: str) -> None:
    """Print past pytest's output capture: the build time, size and frozen output belong in every run's log."""
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is None or reporter is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


@pytest.fixture(scope="module")
def frozen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frozen]:
    existing = layout(REPO / "dist")
    if existing.exe.is_file() and existing.exe.stat().st_mtime > newest_source_mtime():
        say(request, f"\nreusing {existing.root} ({du(existing.root)}), newer than every bundled source")
        yield existing
        return
    pytest.importorskip("PyInstaller", reason="pip install -e '.[packaging]' (make test-packaging does)")
    work = tmp_path_factory.mktemp("pyinstaller")
    start = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "PyInstaller",
            "--noconfirm",
            "--distpath",
            str(work / "dist"),
            "--workpath",
            str(work / "build"),
            str(SPEC),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    elapsed = time.monotonic() - start
    assert r.returncode == 0, f"PyInstaller failed:\n{r.stderr[-6000:]}"
    built = layout(work / "dist")
    say(request, f"\nbuilt {built.root.name} in {elapsed:.0f} s: {du(built.root)}")
    yield built


def run_frozen(frozen: Frozen, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "QT_QPA_PLATFORM": "offscreen",
        # Keep the run off the user's caches and autosaves.
        "MLOT_SPARK_CACHE_DIR": str(tmp_path / "cache"),
        "MLOT_SPARK_DATA_DIR": str(tmp_path / "data"),
    }
    return subprocess.run(
        [str(frozen.exe), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


def test_bundle_contents(frozen: Frozen) -> None:
    assert (frozen.resources / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file(), (
        "the bundled default model is missing"
    )
    assert (frozen.resources / "style" / "spark.qss").is_file()
    assert (frozen.resources / "icons" / "spark.png").is_file()
    assert not (frozen.resources / "packaging").exists(), "build-only inputs were bundled"
    internal = frozen.internal
    for left_out in ("transformers", "tkinter", "hypothesis", "pytest", "torch/test"):
        assert not (internal / left_out).exists(), f"{left_out} should be excluded"
    assert [p.name for p in (internal / "torch" / "bin").iterdir()] == ["torch_shm_manager"]
    assert not list(internal.rglob("libQt6Qml*")), "Qt QML is unused and should be excluded"
    assert list((internal / "engine_native").glob("spark_kernels-*")), "the prebuilt native CPU kernels are missing"


def test_frozen_engine_cli(frozen: Frozen, tmp_path: Path) -> None:
    r = run_frozen(frozen, ["engine", "hw", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    hw = json.loads(r.stdout)
    assert hw["backends"]["cpu"]["available"] is True
    # The bundled kernels run without a compiler: the frozen app never builds them (its cache stays empty).
    r = run_frozen(
        frozen, ["engine", "generate", "--prompt", "Hi", "--max-tokens", "4", "--backend", "cpu", "--json"], tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert "native" in json.loads(r.stdout)["backend_reason"]  # e.g. "cpu, int8 weights, native avx2 kernels"
    assert not (tmp_path / "cache" / "native").exists()


def test_frozen_self_test(frozen: Frozen, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    start = time.monotonic()
    r = run_frozen(frozen, ["--self-test"], tmp_path)
    say(request, f"\nfrozen --self-test: exit {r.returncode} in {time.monotonic() - start:.0f} s\n{r.stdout}{r.stderr}")
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "self-test passed" in r.stdout
