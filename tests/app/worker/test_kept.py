"""Kept memory through the window, as a user meets it: a conversation left, then opened again (after other
conversations pushed it out of RAM, or after a relaunch) reads its memory back and computes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.window.main_window import MainWindow
from app.worker import worker as worker_module
from app.worker.types import MemoryHeld, MemoryReport
from tests.helpers.app_window import WAIT_MS, ScriptedDialogs, dispose, relaunch, say, set_reply_tokens


def restores(window: MainWindow, gui) -> list[object]:  # type: ignore[no-untyped-def]
    """Every "recomputing" progress report the window hears from now on."""
    seen: list[object] = []
    gui(window.client.reading).connect(lambda p: seen.append(p) if p.kind == "restore" else None)
    return seen


def test_a_conversation_pushed_out_of_ram_reads_its_memory_back_from_disk(
    qtbot, window: MainWindow, gui, prefs, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(worker_module, "PARKED_SHARE", 0.0)  # no RAM for conversations left: only the disk keeps them
    set_reply_tokens(prefs, 8)
    say(qtbot, gui, window, "Keep this conversation's memory")
    first = window.state.current_id
    tokens = list(window.client.worker.session.memory.tokens)
    window.menus.new_chat_action.trigger()
    say(qtbot, gui, window, "Another one")
    assert window.client.worker._parked == {}  # nothing stayed in RAM
    recomputing = restores(window, gui)
    reports: list[MemoryReport] = []
    gui(window.client.memory).connect(reports.append)
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_conversation(first)
    session = window.client.worker.session
    assert recomputing == [] and session.computed.count == 0 and session.memory_source == "kept"
    assert list(session.memory.tokens) == tokens
    qtbot.waitUntil(lambda: bool(reports), timeout=WAIT_MS)
    assert reports[-1].held is MemoryHeld.DISK


def test_switching_back_within_ram_computes_nothing(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 8)
    say(qtbot, gui, window, "Stay in RAM")
    first = window.state.current_id
    computed = window.client.worker.conversation.computed_tokens()
    window.menus.new_chat_action.trigger()
    say(qtbot, gui, window, "Another one")
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_conversation(first)
    conversation = window.client.worker.conversation
    assert conversation.computed_tokens() == computed  # handed back, not replayed
    assert conversation.memory_report().held is MemoryHeld.RAM


def test_reopening_after_a_relaunch_reads_the_kept_memory(
    qtbot, window: MainWindow, gui, prefs, dirs, dialogs: ScriptedDialogs, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 8)
    say(qtbot, gui, window, "Remember the number 42")
    say(qtbot, gui, window, "And the colour blue")
    memory = list(window.client.worker.session.memory.tokens)
    window.shutdown()
    assert any((dirs.cache / "kept").iterdir())  # kept at quit (or once idle after the last turn)
    seen: list[str] = []
    again = relaunch(qtbot, prefs, dirs, dialogs, tiny_model, seen)
    try:
        session = again.client.worker.session
        assert session.memory_source == "kept" and session.computed.count == 0
        assert list(session.memory.tokens) == memory
    finally:
        dispose(again)


def test_settings_shows_the_kept_memory_and_clear_loses_no_conversation(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    from app.settings.settings_dialog import SettingsDialog

    set_reply_tokens(prefs, 8)
    say(qtbot, gui, window, "Keep me")
    first = window.state.current_id
    window.menus.new_chat_action.trigger()  # leaving keeps it on disk
    qtbot.waitUntil(lambda: window.dialogs.kept is not None and window.dialogs.kept.kept.usage().entries > 0)
    dialog = SettingsDialog(prefs.generation(), window, kept=window.dialogs.kept)
    assert dialog.kept is not None and "for 1 conversation" in dialog.kept.usage.text()
    dialog.kept.budget.setValue(0.5)
    dialog.accept()
    assert prefs.kept_budget_bytes() == 512 * 1024**2 and window.dialogs.kept.kept.budget_bytes == 512 * 1024**2
    dialog = SettingsDialog(prefs.generation(), window, kept=window.dialogs.kept)
    assert dialog.kept is not None
    dialog.kept.clear_button.click()
    assert "0 conversations" in dialog.kept.usage.text()
    window.client.worker._parked.clear()  # as if RAM had let it go too: it recomputes, its words all there
    recomputing = restores(window, gui)
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_conversation(first)
    assert window.client.worker.session.memory_source == "recomputed" and recomputing
    assert "Keep me" in window.chat.toPlainText()


def test_the_inspector_says_where_the_memory_came_from_in_plain_words() -> None:
    from app.inspector.inspector import kept_words
    from engine import TierStats

    working = TierStats("working", 40, 400, 900, 0, 0, 0.0, 0)
    assert kept_words(MemoryReport((working,), 40, "", MemoryHeld.RAM)).startswith("It stayed in RAM")
    disk = kept_words(MemoryReport((working,), 40, "", MemoryHeld.DISK, 2048))
    assert "read back from the memory kept on disk" in disk and "A copy is kept on disk (2" in disk
    assert "recomputed" in kept_words(MemoryReport((working,), 40, "", MemoryHeld.RECOMPUTED))
    assert kept_words(MemoryReport((), 0, "http://server")) == ""


def test_deleting_a_conversation_deletes_its_kept_memory(  # type: ignore[no-untyped-def]
    qtbot, window: MainWindow, gui, prefs, dirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "KEEP_DELAY_MS", 0)  # kept as soon as the worker is idle
    set_reply_tokens(prefs, 8)
    say(qtbot, gui, window, "Forget me")
    first = window.state.current_id
    assert window.dialogs.kept is not None
    kept, path = window.dialogs.kept.kept, window.library.path_for(first)
    qtbot.waitUntil(lambda: kept.pending(path) is None and kept.entry_path(path).is_file(), timeout=WAIT_MS)
    window.commands.delete(first)
    qtbot.waitUntil(lambda: not kept.entry_path(path).exists() and kept.pending(path) is None, timeout=WAIT_MS)
    window.shutdown()  # quit keeps the conversations left in RAM: the deleted one is no longer among them
    assert kept.usage().entries == 0
