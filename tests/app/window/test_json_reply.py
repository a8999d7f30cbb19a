""" "Reply as JSON": turned on from the Chat menu with a schema, a reply parses and validates against it; it belongs
to the conversation it was turned on in (another conversation, a new one and an old settings file's global switch
leave replies plain; the library keeps it across a restart), and the chat says so where it is on; turning it on and
cancelling the schema leaves it off; a schema the engine refuses is one sentence in the dialog."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from app.history.library import ConversationLibrary, new_id
from app.settings.json_reply import SchemaDialog
from app.window.main_window import MainWindow
from tests.helpers.app_window import WAIT_MS, ScriptedDialogs, set_reply_tokens

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def test_reply_as_json_gives_a_reply_matching_the_schema(
    qtbot, window: MainWindow, gui, prefs, dialogs: ScriptedDialogs
) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 64)  # the schema is bounded: the reply closes well within this
    dialogs.schema = json.dumps(SCHEMA)
    window.menus.reply_json_action.trigger()
    assert window.menus.reply_json_action.isChecked() and window.composer.json_chip.isVisibleTo(window)
    assert json.loads(window.library.reply_schema(window.state.current_id)) == SCHEMA
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        assert window.submit("Is the sky blue?")
    reply = blocker.args[0].text
    jsonschema.validate(json.loads(reply), SCHEMA)
    window.menus.reply_json_action.trigger()
    assert window.reply_settings().grammar is None and not window.composer.json_chip.isVisibleTo(window)


def test_reply_as_json_is_the_conversations_own(qtbot, window: MainWindow, prefs, dialogs: ScriptedDialogs) -> None:  # type: ignore[no-untyped-def]
    prefs.settings.setValue("chat/reply_json", "true")  # an older file's global switch turns nothing on
    assert window.reply_settings().grammar is None and not window.menus.reply_json_action.isChecked()
    dialogs.schema = json.dumps(SCHEMA)
    window.menus.reply_json_action.trigger()
    json_id = window.state.current_id
    assert window.reply_settings().grammar is not None
    window.commands.new_chat()  # another conversation: plain replies, and nothing in it says JSON
    assert window.state.current_id != json_id
    assert window.reply_settings().grammar is None
    assert not window.menus.reply_json_action.isChecked() and not window.composer.json_chip.isVisibleTo(window)
    assert prefs.settings.value("chat/reply_json") == "true"  # untouched, and unread


def test_the_library_keeps_a_conversations_schema_across_a_restart(tmp_path: Path) -> None:
    lib = ConversationLibrary(tmp_path)
    lib.load()
    on, off = new_id(), new_id()
    lib.set_reply_schema(on, json.dumps(SCHEMA))  # before it is first stored: kept until it is
    for cid in (on, off):
        lib.path_for(cid).write_bytes(b"stored")
        lib.record(cid, [("user", "hi"), ("assistant", "{}")], "m")
    lib.close()
    again = ConversationLibrary(tmp_path)
    again.load()
    assert json.loads(again.reply_schema(on)) == SCHEMA and again.reply_schema(off) == ""
    again.close()


def test_turning_it_on_without_a_schema_and_cancelling_leaves_it_off(
    window: MainWindow, prefs, dialogs: ScriptedDialogs
) -> None:  # type: ignore[no-untyped-def]
    dialogs.schema = None
    window.menus.reply_json_action.trigger()
    assert dialogs.asked == ["schema"]
    assert not window.menus.reply_json_action.isChecked()
    assert window.library.reply_schema(window.state.current_id) == ""


def test_schema_dialog_refuses_a_bad_schema_in_one_sentence(qtbot) -> None:  # type: ignore[no-untyped-def]
    d = SchemaDialog("")
    qtbot.addWidget(d)
    assert json.loads(d.value())["type"] == "object"  # an example to start from
    for bad in ('{"type": ', "[1, 2]", '{"type": "no such type"}'):
        d.editor.setPlainText(bad)
        d.accept()
        assert d.result() != SchemaDialog.DialogCode.Accepted
        text = d.error.text()
        assert text and "\n" not in text and "Traceback" not in text
    d.editor.setPlainText(json.dumps(SCHEMA))
    d.accept()
    assert d.result() == SchemaDialog.DialogCode.Accepted
