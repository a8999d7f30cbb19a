"""The kept copy on disk is written beside the worker, not by it: a conversation is handed back, and a message sent,
while a write is still in flight (held here by a file system that waits for the test); Quit abandons a write it
cannot wait for and leaves no temp file; a deleted conversation's kept memory goes with it."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import wiring
from app.misc.signal_wait import GuiRelay
from app.misc.standarddirs import StandardDirs
from app.settings.preferences import Preferences
from app.window.main_window import MainWindow
from app.worker import worker as worker_module
from app.worker.types import MemoryHeld
from engine import KeptMemory
from tests.helpers.app_window import WAIT_MS, ScriptedDialogs, ScriptedThermal, dispose, say, set_reply_tokens
from tests.helpers.held_writes import HeldWrites


@pytest.fixture
def held() -> Iterator[HeldWrites]:
    fs = HeldWrites()
    yield fs
    fs.release.set()  # the writer thread ends whatever the test did


@pytest.fixture
def window(  # type: ignore[no-untyped-def]
    qtbot,
    tiny_model: Path,
    prefs: Preferences,
    dirs: StandardDirs,
    dialogs: ScriptedDialogs,
    thermal: ScriptedThermal,
    held: HeldWrites,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[MainWindow]:
    monkeypatch.setattr(wiring, "KeptMemory", functools.partial(KeptMemory, fs=held))
    monkeypatch.setattr(worker_module, "KEEP_DELAY_MS", 0)  # kept as soon as the worker is idle
    w = wiring.build_main_window(prefs, dirs, dialogs, thermal)
    with qtbot.waitSignal(GuiRelay(w.client.loaded, parent=w).fired, timeout=WAIT_MS):
        w.load_model(tiny_model, "cpu")
    yield w
    held.release.set()
    dispose(w)


def kept_of(window: MainWindow) -> KeptMemory:
    assert window.dialogs.kept is not None
    return window.dialogs.kept.kept


def test_switching_back_and_sending_do_not_wait_for_a_write_in_flight(  # type: ignore[no-untyped-def]
    qtbot, window: MainWindow, gui, prefs, held: HeldWrites
) -> None:
    set_reply_tokens(prefs, 8)
    say(qtbot, gui, window, "Keep this conversation")
    first = window.state.current_id
    path = window.library.path_for(first)
    qtbot.waitUntil(held.started.is_set, timeout=WAIT_MS)  # its copy is being written, and held there
    computed = window.client.worker.conversation.computed_tokens()
    window.menus.new_chat_action.trigger()
    say(qtbot, gui, window, "Another one")  # a send while the write is held
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_conversation(first)  # and a switch back
    assert kept_of(window).pending(path) is not None and not held.release.is_set()  # still in flight
    conversation = window.client.worker.conversation
    assert conversation.computed_tokens() == computed and conversation.memory_report().held is MemoryHeld.RAM
    held.release.set()
    assert kept_of(window).flush(60) and kept_of(window).entry_path(path).is_file()


def test_quit_abandons_a_write_in_flight_and_leaves_no_temp_file(  # type: ignore[no-untyped-def]
    qtbot, window: MainWindow, gui, prefs, dirs: StandardDirs, held: HeldWrites
) -> None:
    set_reply_tokens(prefs, 8)
    say(qtbot, gui, window, "Keep this conversation")
    qtbot.waitUntil(held.started.is_set, timeout=WAIT_MS)
    assert any(p.name.endswith(".tmp") for p in (dirs.cache / "kept").iterdir())
    assert window.shutdown()  # within Quit's wait, though the write never finished
    assert list((dirs.cache / "kept").iterdir()) == []
    held.release.set()
    assert kept_of(window).flush(60)  # the writer stops at its next call, leaving nothing
    assert list((dirs.cache / "kept").iterdir()) == []
