"""Fixtures for the app tests: offscreen Qt, a tiny random model, scratch settings/dirs, scripted dialogs, and a
main window with the model loaded."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt creates the QApplication

from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings, SignalInstance

from app.application import SparkApplication
from app.misc.signal_wait import GuiRelay
from app.misc.standarddirs import StandardDirs
from app.settings.preferences import Preferences
from app.window.main_window import MainWindow
from app.wiring import build_main_window
from tests.helpers.app_window import (
    REPLY_TOKENS,
    WAIT_MS,
    ScriptedDialogs,
    ScriptedThermal,
    dispose,
    set_reply_tokens,
)
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="session")
def qapp_cls() -> type[SparkApplication]:
    return SparkApplication


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def dirs(tmp_path: Path) -> StandardDirs:
    d = StandardDirs(cache=tmp_path / "cache", data=tmp_path / "data", documents=tmp_path)
    d.ensure()
    return d


@pytest.fixture
def settings_file(tmp_path: Path) -> Path:
    return tmp_path / "settings.ini"


@pytest.fixture
def prefs(settings_file: Path) -> Preferences:
    p = Preferences(QSettings(str(settings_file), QSettings.Format.IniFormat))
    set_reply_tokens(p, REPLY_TOKENS)
    return p


@pytest.fixture
def dialogs() -> ScriptedDialogs:
    return ScriptedDialogs()


@pytest.fixture
def thermal() -> ScriptedThermal:
    return ScriptedThermal()


@pytest.fixture
def window(
    qtbot, tiny_model: Path, prefs: Preferences, dirs: StandardDirs, dialogs: ScriptedDialogs, thermal: ScriptedThermal
) -> Iterator[MainWindow]:  # type: ignore[no-untyped-def]
    w = build_main_window(prefs, dirs, dialogs, thermal)
    with qtbot.waitSignal(GuiRelay(w.client.loaded, parent=w).fired, timeout=WAIT_MS):
        w.load_model(tiny_model, "cpu")
    yield w
    dispose(w)


@pytest.fixture
def gui(window: MainWindow):  # type: ignore[no-untyped-def]
    """gui(worker.signal) -> the same signal re-emitted on the GUI thread (pytest-qt's waitSignal is not thread-safe:
    its callback would run on the worker's thread)."""

    def relay(signal: SignalInstance) -> SignalInstance:
        return GuiRelay(signal, parent=window).fired

    return relay
