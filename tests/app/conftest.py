"""Fixtures for the app tests: offscreen Qt, a tiny random model, scratch settings/dirs, scripted dialogs, and a
main window with the model loaded."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt creates the QApplication

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from PySide6.QtCore import QCoreApplication, QEvent, QSettings, SignalInstance

from app.application import SparkApplication
from app.dialogs import Dialogs
from app.main_window import MainWindow
from app.preferences import Preferences
from app.signal_wait import GuiRelay
from app.standarddirs import StandardDirs
from app.wiring import build_main_window
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.hw import ThermalReading, ThermalState
from engine.openai.client import RemoteServer
from tests.helpers.tiny import make_tiny_model

WAIT_MS = 30_000
REPLY_TOKENS = 12  # every streamed reply in these tests; long ones set their own


@pytest.fixture(scope="session")
def qapp_cls() -> type[SparkApplication]:
    return SparkApplication


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@dataclass
class ScriptedDialogs(Dialogs):
    """Answers the window's questions from the test's script and records what was asked."""

    confirm_answer: bool = True
    save_to: Path | None = None
    open_from: Path | None = None
    model_from: Path | None = None
    new_settings: GenerationSettings | None = None
    answer_text: str | None = None
    export_to: Path | None = None
    server_to_add: RemoteServer | None = None
    asked: list[str] = field(default_factory=list)
    save_starts: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(None)

    def confirm(self, title: str, text: str, accept: str) -> bool:
        self.asked.append(text)
        return self.confirm_answer

    def save_path(self, start: Path) -> Path | None:
        self.asked.append("save")
        self.save_starts.append(start)
        return self.save_to

    def export_path(self, start: Path, kind: str) -> Path | None:
        self.asked.append(f"export {start}")
        return self.export_to

    def ask_text(self, title: str, label: str, current: str) -> str | None:
        self.asked.append(title)
        return self.answer_text

    def model_file(self, start: Path) -> Path | None:
        self.asked.append("model file")
        return self.model_from

    def about(self) -> None:
        self.asked.append("about")

    def help(self, keys: list[tuple[str, str]]) -> None:
        self.asked.append("help")
        self.help_keys = keys

    def open_path(self, start: Path) -> Path | None:
        self.asked.append("open")
        return self.open_from

    def model_dir(self, start: Path) -> Path | None:
        self.asked.append("model")
        return self.model_from

    def add_server(self) -> RemoteServer | None:
        self.asked.append("add server")
        return self.server_to_add

    def edit_settings(self, current: GenerationSettings) -> GenerationSettings | None:
        self.asked.append("settings")
        return self.new_settings


class ScriptedThermal:
    """A thermal source whose state the test sets; like macOS's notification, a change tells the subscribers."""

    def __init__(self) -> None:
        self.state = ThermalState.NOMINAL
        self._listeners: list[Callable[[], None]] = []

    def read(self) -> ThermalReading:
        return ThermalReading(self.state, "test sensor", 42.0, "cpu")

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def change(self, state: ThermalState) -> None:
        self.state = state
        for listener in list(self._listeners):
            listener()


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
    p.set_generation(GenerationSettings(max_tokens=REPLY_TOKENS, sampling=SamplingSettings(seed=0)))
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
    with qtbot.waitSignal(GuiRelay(w.client.worker.loaded, parent=w).fired, timeout=WAIT_MS):
        w.load_model(tiny_model, "cpu")
    yield w
    dispose(w)


def dispose(w: MainWindow) -> None:
    """End the worker threads, then destroy the window and collect its Python cycles here, on the GUI thread.

    Otherwise the cyclic garbage collector may free the old window's wrappers later on a worker thread (a later
    test's generation loop), and PySide's deferred deletion of those widgets crashes.
    """
    w.shutdown()
    w.close()
    w.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    gc.collect()


def set_reply_tokens(prefs: Preferences, n: int) -> None:
    prefs.set_generation(GenerationSettings(max_tokens=n, sampling=SamplingSettings(seed=0)))


@pytest.fixture
def gui(window: MainWindow):  # type: ignore[no-untyped-def]
    """gui(worker.signal) -> the same signal re-emitted on the GUI thread (pytest-qt's waitSignal is not thread-safe:
    its callback would run on the worker's thread)."""

    def relay(signal: SignalInstance) -> SignalInstance:
        return GuiRelay(signal, parent=window).fired

    return relay
