"""Nothing lost (stored as it changes, quit, relaunch), the history sidebar (search, rename, delete + undo,
duplicate, branch with memory, export), compact Save a Copy, and the command line's paths."""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QLineEdit

from app.__main__ import open_startup, parse_args
from app.history.library import ConversationLibrary, title_from
from app.history.sidebar import when_text
from app.misc.signal_wait import GuiRelay
from app.window.main_window import MainWindow
from app.wiring import build_main_window
from engine.session.file import inspect_session, load_session
from tests.helpers.app_window import WAIT_MS, ScriptedDialogs, dispose, relaunch, say


def test_quit_with_unsaved_work_loses_nothing_and_relaunch_restores_it(
    qtbot, window: MainWindow, gui, prefs, dirs, dialogs: ScriptedDialogs, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "Remember the number 42")
    say(qtbot, gui, window, "And the colour blue")
    reply = window.chat.reply_text()
    memory = list(window.client.worker.session.memory.tokens)
    title = window.windowTitle()
    window.close()  # ⌘W, then ⌘Q: no question about saving
    window.shutdown()
    assert dialogs.asked == []
    seen: list[str] = []
    again = relaunch(qtbot, prefs, dirs, dialogs, tiny_model, seen)
    try:
        assert "Remember the number 42" in again.chat.toPlainText() and again.chat.reply_text() == reply
        assert again.windowTitle() == title
        assert seen[:2] == ["conversation_shown", "conversation_shown"]  # the words showed before the memory was ready
        assert again.client.worker.session.memory.tokens == memory  # the memory came back, not just the words
        assert again.sidebar.ids()[0] == again.state.current_id
        with qtbot.waitSignal(GuiRelay(again.client.finished, parent=again).fired, timeout=WAIT_MS) as blocker:
            again.submit("What did I ask first?")
        assert blocker.args[0].progress.prompt_tokens < len(memory)  # nothing re-read
    finally:
        dispose(again)


def test_every_change_is_stored_atomically_in_the_data_folder(qtbot, window: MainWindow, gui, dirs) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "Keep me safe")
    path = window.library.path_for(window.state.current_id)
    stored = load_session(path)
    assert stored.messages[0].content == "Keep me safe"
    assert inspect_session(path)["memory_kind"] == "recompute"  # compact: transcript, ids and the recipe
    window.library.flush()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    index = json.loads((dirs.conversations / "index.json").read_text())
    assert [c["title"] for c in index["conversations"]] == ["Keep me safe"]


def test_search_rename_delete_and_undo(qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "Plan a trip to Lisbon")
    lisbon = window.state.current_id
    window.menus.new_chat_action.trigger()
    say(qtbot, gui, window, "Bake sourdough bread")
    bread = window.state.current_id
    window.sidebar.search.setText("lisbon")
    assert window.sidebar.ids() == [lisbon]
    window.sidebar.search.setText("")
    assert window.sidebar.ids() == [bread, lisbon]

    assert window.sidebar.start_rename(lisbon)  # in place, as Finder renames
    editor = window.sidebar.list.findChild(QLineEdit)
    assert editor is not None and editor.text() == "Plan a trip to Lisbon"
    editor.setText("Holiday")
    window.sidebar.list.commitData(editor)  # what Return in the editor does
    assert window.library.get(lisbon).title == "Holiday"

    memory = list(window.client.worker.session.memory.tokens)
    window.menus.delete_action.trigger()  # ⌘⌫ on the open conversation
    assert window.library.get(bread) is None and window.sidebar.ids() == [lisbon]
    assert not window.library.path_for(bread).exists()
    assert "Bake sourdough" not in window.chat.toPlainText()
    assert window.menus.undo_action.text() == "Undo Delete"
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.menus.undo_action.trigger()
    assert window.state.current_id == bread and "Bake sourdough bread" in window.chat.toPlainText()
    assert window.client.worker.session.memory.tokens == memory
    assert window.sidebar.ids() == [bread, lisbon]


def test_branch_at_a_message_restores_that_points_memory(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "First question")
    after_first = window.client.worker.session.messages[:2]
    say(qtbot, gui, window, "Second question")
    source = window.state.current_id
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.chat._on_anchor(QUrl("branch:1"))  # "Branch" on the first reply
    session = window.client.worker.session
    assert window.state.current_id != source
    assert [(m.role, m.content) for m in session.messages] == [(m.role, m.content) for m in after_first]
    assert "Second question" not in window.chat.toPlainText()
    tok = session.tokenizer
    rendered = tok.apply_chat_template([m.as_template_dict() for m in after_first], add_generation_prompt=False)
    assert tok.decode(list(session.memory.tokens), skip_special=False) == rendered  # memory holds exactly that point
    qtbot.waitUntil(lambda: window.library.get(window.state.current_id) is not None, timeout=WAIT_MS)
    assert window.library.get(window.state.current_id).title == "First question (branch)"
    assert window.library.get(source) is not None  # the original stays
    result = say(qtbot, gui, window, "A different second question")
    assert result.progress.prompt_tokens < len(session.memory.tokens)  # the branch continues from its memory


def test_duplicate_and_export(qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "Export me")
    source = window.state.current_id
    reply = window.chat.reply_text()
    dialogs.export_to = tmp_path / "talk.md"
    window.menus.export_md_action.trigger()
    md = (tmp_path / "talk.md").read_text()
    assert md.startswith("# Export me") and "**You:**" in md and "Export me" in md
    dialogs.export_to = tmp_path / "talk.json"
    window.menus.export_json_action.trigger()
    data = json.loads((tmp_path / "talk.json").read_text())
    assert data["title"] == "Export me" and [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert dialogs.asked[-2:] == [
        f"export {tmp_path / 'Export me.md'}",
        f"export {tmp_path / 'Export me.json'}",
    ]  # Documents, titled
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.menus.duplicate_action.trigger()
    assert window.state.current_id != source and window.library.get(window.state.current_id).title == "Export me (copy)"
    assert window.chat.reply_text() == reply


def test_save_a_copy_is_compact_by_default_and_full_on_request(
    qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "Size me")
    dialogs.save_to = tmp_path / "small.spark"
    with qtbot.waitSignal(gui(window.client.saved), timeout=WAIT_MS):
        window.menus.save_action.trigger()
    assert dialogs.save_starts[-1] == window.dirs.documents / "Size me.spark"  # Documents, with the title
    dialogs.save_to = tmp_path / "full.spark"
    with qtbot.waitSignal(gui(window.client.saved), timeout=WAIT_MS):
        window.menus.save_full_action.trigger()
    small, full = inspect_session(tmp_path / "small.spark"), inspect_session(tmp_path / "full.spark")
    assert small["tensor_bytes"] == 0 and full["tensor_bytes"] > 0
    assert (
        small["file_bytes"] < full["file_bytes"]
    )  # (the tiny test model's KV is small; the real model's figure is in the README)


def test_library_survives_a_broken_index(tmp_path: Path) -> None:
    lib = ConversationLibrary(tmp_path)
    lib.load()
    cid = "0123456789abcdef"
    lib.path_for(cid).write_bytes(b"x")
    lib.record(cid, [("user", "hello")], "m")
    lib.close()
    (tmp_path / "index.json").write_text("{broken")
    again = ConversationLibrary(tmp_path)
    again.load()
    assert "could not be read" in again.load_error
    assert again.get(cid) is not None  # the file is still listed
    assert title_from("  a   very long first message that goes on and on beyond the width of any sidebar ").endswith(
        "…"
    )


def test_paths_on_the_command_line_open_after_the_model_loads(
    qtbot, window: MainWindow, gui, prefs, dirs, dialogs: ScriptedDialogs, tiny_model: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "Open me from the shell")
    talk = tmp_path / "talk.spark"
    dialogs.save_to = talk
    with qtbot.waitSignal(gui(window.client.saved), timeout=WAIT_MS):
        window.menus.save_action.trigger()
    window.shutdown()
    args = parse_args([str(talk), str(tiny_model), "--backend", "cpu"])  # `python -m app talk.spark MODEL`
    again = build_main_window(prefs, dirs, dialogs)
    try:
        with qtbot.waitSignal(GuiRelay(again.client.restored, parent=again).fired, timeout=WAIT_MS) as blocker:
            open_startup(again, args, None)
        assert (
            blocker.args[0].path == talk and again.state.file == talk
        )  # the file asked for, not the last conversation
        assert "Open me from the shell" in again.chat.toPlainText()
    finally:
        dispose(again)


def test_dropping_a_gguf_loads_it_as_a_model(qtbot, window: MainWindow, gui, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # not a real model: the engine refuses it in one sentence, the chat stays
    with qtbot.waitSignal(gui(window.client.loading), timeout=WAIT_MS) as blocker:
        window.handle_drop([gguf], 1)
    assert blocker.args[0] == str(gguf)


def test_copy_button_copies_one_message_without_its_label(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    result = say(qtbot, gui, window, "Copy this exact text")
    window.chat._on_anchor(QUrl("copy:0"))
    assert QGuiApplication.clipboard().text() == "Copy this exact text"
    window.chat._on_anchor(QUrl("copy:1"))
    assert QGuiApplication.clipboard().text() == result.text  # the reply as written, without its "Spark" label


def test_notes_under_replies_come_back_with_the_conversation(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    from tests.helpers.app_window import set_reply_tokens

    set_reply_tokens(prefs, 400)
    with qtbot.waitSignal(window.coalescer.flushed, timeout=WAIT_MS):
        window.submit("Stop me midway")
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.menus.stop_action.trigger()
    assert "Stopped." in window.chat.toPlainText()
    first = window.state.current_id
    window.menus.new_chat_action.trigger()
    assert "Stopped." not in window.chat.toPlainText()
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.menus.undo_action.trigger()
    assert window.state.current_id == first and "Stopped." in window.chat.toPlainText()


def test_going_back_to_a_conversation_just_left_needs_no_recompute(qtbot, window: MainWindow, gui) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "Stay warm")
    first = window.state.current_id
    window.menus.new_chat_action.trigger()
    say(qtbot, gui, window, "Another one")
    restoring: list[object] = []
    gui(window.client.reading).connect(lambda p: restoring.append(p) if p.kind == "restore" else None)
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_conversation(first)
    assert restoring == []  # its memory was kept ready, not rebuilt from the file
    assert "Stay warm" in window.chat.toPlainText()
    second = window.sidebar.ids()[0] if window.sidebar.ids()[0] != first else window.sidebar.ids()[1]
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_conversation(second)
    assert restoring == [] and "Another one" in window.chat.toPlainText()


def test_rows_say_when_in_relative_words_and_repeated_questions_read_apart(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    assert when_text(now - 20, now) == "Just now" and when_text(now - 600, now) == "10 min ago"
    library = ConversationLibrary(tmp_path)
    library.load()
    first, second = "0123456789abcdef", "fedcba9876543210"
    for cid, reply in ((first, "Paris is the capital."), (second, "The capital of France is Paris.")):
        library.path_for(cid).write_bytes(b"")
        library.record(cid, [("user", "What is the capital of France?"), ("assistant", reply)], "m")
    assert library.get(first).title == "What is the capital of France?"
    assert library.get(second).title.startswith("What is the capital of France? — The capital of")


def test_opening_a_file_already_in_the_history_selects_it(
    qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    say(qtbot, gui, window, "Keep me once")
    talk = tmp_path / "once.spark"
    dialogs.save_to = talk
    with qtbot.waitSignal(gui(window.client.saved), timeout=WAIT_MS):
        window.menus.save_action.trigger()
    first = window.state.current_id
    window.commands.new_chat()
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_file(talk)  # opened from the file manager: a new conversation from the file
    copy = window.state.current_id
    qtbot.waitUntil(lambda: len(window.library.entries()) == 2)  # stored into the history
    assert copy != first and window.library.get(copy).origin
    window.commands.new_chat()
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_file(talk)  # again: the conversation it became is selected, not a third copy
    assert window.state.current_id == copy and len(window.library.entries()) == 2
    window.commands.new_chat()
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_file(window.library.path_for(first))  # one of the history's own files: that conversation
    assert window.state.current_id == first and len(window.library.entries()) == 2
