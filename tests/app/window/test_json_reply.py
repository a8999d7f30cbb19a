""" "Reply as JSON": turned on from the Chat menu with a schema, a reply parses and validates against it; turning
it on and cancelling the schema leaves it off; a schema the engine refuses is one sentence in the dialog."""

from __future__ import annotations

import json

import jsonschema

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
    assert window.menus.reply_json_action.isChecked() and prefs.reply_as_json()
    assert json.loads(prefs.reply_schema()) == SCHEMA  # kept in the preferences with the system prompt
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        assert window.submit("Is the sky blue?")
    reply = blocker.args[0].text
    jsonschema.validate(json.loads(reply), SCHEMA)
    window.menus.reply_json_action.trigger()
    assert not prefs.reply_as_json() and window.reply_settings().grammar is None


def test_turning_it_on_without_a_schema_and_cancelling_leaves_it_off(
    window: MainWindow, prefs, dialogs: ScriptedDialogs
) -> None:  # type: ignore[no-untyped-def]
    dialogs.schema = None
    window.menus.reply_json_action.trigger()
    assert dialogs.asked == ["schema"]
    assert not window.menus.reply_json_action.isChecked() and not prefs.reply_as_json()


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
