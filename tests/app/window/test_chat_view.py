"""The chat view on its own: it follows a streaming reply unless the user scrolled up (then the "↓ New text" pill),
renders Markdown (inline code, highlighted code blocks with Copy, tables), collapses long pastes, greets an
empty conversation with example prompts, and shows tool calls as cards."""

from __future__ import annotations

import json

from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication, QTextCharFormat

from app.window import chat_view, message_actions
from app.window.chat_view import ChatView
from app.window.markdown import MarkdownRenderer, Palette
from app.window.tool_cards import Card, segments
from app.worker.tool_turns import TOOL_ROLE, ToolStatus, response_block
from app.worker.types import MessageView
from tests.helpers.app_window import shown_chat_view


def _stream(view: ChatView, lines: int) -> None:
    for i in range(lines):
        view.append_reply(f"line {i} of a long reply\n")


def test_follows_the_stream_until_the_user_scrolls_up(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    view.add_user_message("Tell me a long story")
    view.begin_reply()
    _stream(view, 80)
    bar = view.verticalScrollBar()
    assert bar.maximum() > 0 and bar.value() == bar.maximum()  # the newest text is in view
    assert view.pill.isHidden()

    bar.setValue(0)  # the user scrolls up to read
    assert not view.following()
    _stream(view, 40)
    assert bar.value() == 0  # left where the user is reading
    assert view.pill.isVisible()  # ...told that more came

    view.pill.click()
    assert view.following() and bar.value() == bar.maximum() and view.pill.isHidden()
    _stream(view, 20)
    assert bar.value() == bar.maximum()


def _fonts_of(view: ChatView, word: str) -> QTextCharFormat:
    cursor = view.document().find(word)
    assert not cursor.isNull(), word
    return cursor.charFormat()


def test_markdown_inline_code_code_blocks_and_tables(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    reply = (
        "Call `compute_total` first.\n\n"
        "```python\ndef compute_total(items):\n    return sum(items)\n```\n\n"
        "| Name | Size |\n|------|------|\n| alpha | 3 |\n| beta | 5 |\n"
    )
    view.set_messages([MessageView("user", "Show me"), MessageView("assistant", reply)])
    text = view.toPlainText()
    assert "`compute_total`" not in text and "compute_total" in text  # inline code: no backticks shown
    assert "```" not in text and "|------|" not in text

    inline = _fonts_of(view, "compute_total")
    assert inline.fontFixedPitch() or "Mono" in inline.fontFamilies()[0] or inline.fontFamilies()[0] == "monospace"

    # The code block is coloured: its keyword and a plain name differ in colour.
    keyword = _fonts_of(view, "def").foreground().color()
    plain = _fonts_of(view, "items").foreground().color()
    assert keyword != plain

    # The table is a table: a header row and two rows, each cell its own.
    cursor = view.document().find("beta")
    assert cursor.currentTable() is not None and cursor.currentTable().rows() == 3

    # Copy on the block copies exactly its code.
    view.anchorClicked.emit(QUrl("copycode:1.0"))
    assert QGuiApplication.clipboard().text() == "def compute_total(items):\n    return sum(items)"


def test_a_long_code_line_wraps_inside_the_chat_and_copies_as_written(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    line = "total = " + " + ".join(f"item_{i}.price" for i in range(30))  # far wider than the view
    view.set_messages([MessageView("user", "Sum them"), MessageView("assistant", f"```python\n{line}\n```\n")])
    assert view.horizontalScrollBar().maximum() == 0  # the conversation does not scroll sideways
    assert view.document().size().width() <= view.viewport().width()
    view.anchorClicked.emit(QUrl("copycode:1.0"))
    assert QGuiApplication.clipboard().text() == line  # one line, as written


def test_streamed_reply_is_rendered_when_it_ends(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    view.add_user_message("Code please")
    view.begin_reply()
    for piece in ["Here: `x", " = 1`", "\n\n```sh\necho hi\n", "```\n"]:
        view.append_reply(piece)
    view.end_reply()
    assert "`" not in view.toPlainText()
    assert view.reply_text() == "Here: `x = 1`\n\n```sh\necho hi\n```\n"  # Copy gives the Markdown as written


def test_a_long_paste_is_collapsed_until_show_all(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    paste = "\n".join(f"row {i}" for i in range(200))
    view.add_user_message(paste)
    assert "row 199" not in view.toPlainText() and "Show all (200 lines" in view.toPlainText()
    view.anchorClicked.emit(QUrl("expand:0"))
    assert "row 199" in view.toPlainText() and "Show all" not in view.toPlainText()
    view.copy_message(0)
    assert QGuiApplication.clipboard().text() == paste
    view.add_user_message("word " * 1200)  # one long line: counted in characters only
    assert "Show all (6,000 characters)" in view.toPlainText()


def test_an_empty_conversation_greets_with_example_prompts(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    view.set_greeting("Ready.", ["What is the capital of France?", "Write a haiku."])
    view.set_messages([])
    assert "Ready." in view.toPlainText() and "Write a haiku." in view.toPlainText()
    chosen: list[str] = []
    view.example_chosen.connect(chosen.append)
    view.anchorClicked.emit(QUrl("example:1"))
    assert chosen == ["Write a haiku."]
    view.add_user_message("Hello")
    assert "Ready." not in view.toPlainText()  # the greeting goes with the first message


CALL = '<tool_call>\n{"name": "demo__add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_a_tool_call_shows_as_a_card_restored_and_live_alike(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    long = "x" * 1000
    result = json.dumps({"name": "demo__add", "status": ToolStatus.OK, "content": long})
    denied = json.dumps({"name": "demo__add", "status": ToolStatus.DENIED, "content": "The user did not allow it."})
    messages = [
        MessageView("user", "Add 1 and 2."),
        MessageView("assistant", f"Calling the tool.\n{CALL}"),
        MessageView(TOOL_ROLE, result),
        MessageView("assistant", CALL),
        MessageView(TOOL_ROLE, denied),
        MessageView("assistant", "It is 3."),
    ]
    view.set_messages(messages)
    restored = view.toPlainText()
    assert "<tool_call>" not in restored and "<tool_response>" not in restored and '"status"' not in restored
    assert restored.count("Tool · demo__add") == 2 and '"a": 1,\n  "b": 2' in restored  # arguments pretty-printed
    assert "Allowed · ran" in restored and "Denied · did not run" in restored
    assert "Result: xxx" in restored and long not in restored  # folded: the model had it whole
    assert restored.index("Calling the tool.") < restored.index("Allowed · ran") < restored.index("It is 3.")
    assert restored.count("Spark") == 1 and view.last_index() == 5  # one reply, indexed by its last message
    # Live: the same text streams (a result block after each call), and ends indexed as the file has it.
    view.set_messages(messages[:1])
    view.begin_reply()
    view.append_reply("Calling the tool.\n" + CALL[:20])
    assert "<tool_call>" not in view.toPlainText()  # a call being written is never shown raw
    view.append_reply(CALL[20:])
    assert "Waiting for your answer…" in view.toPlainText()  # closed: its card shows at once, while consent is asked
    for piece in (response_block(result), CALL, response_block(denied), "It is 3."):
        view.append_reply(piece)
    view.end_reply("", 5)
    assert view.toPlainText() == restored and view.last_index() == 5


def test_a_call_waiting_for_consent_and_a_call_that_is_not_one() -> None:
    parts = segments(f"{CALL}\n<tool_call>\nnot json\n</tool_call>")
    assert parts[0] == Card("demo__add", '{\n  "a": 1,\n  "b": 2\n}')  # no result yet: waiting
    assert parts[1:] == ["\n<tool_call>\nnot json\n</tool_call>"]  # left as the model wrote it
    assert segments('<tool_call>\n{"na') == [Card("", "")]  # still being written


def _link_texts(view: ChatView, href: str) -> list[str]:
    out = []
    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            f = it.fragment()
            if f.charFormat().isAnchor() and f.charFormat().anchorHref() == href:
                out.append(f.text())
            it += 1
        block = block.next()
    return out


def test_copy_says_copied_where_it_was_clicked_then_copy_again(qtbot, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(chat_view, "COPIED_MS", 10)
    monkeypatch.setattr(message_actions, "COPIED_MS", 10)
    view = shown_chat_view(qtbot)
    view.set_messages([MessageView("user", "Show me"), MessageView("assistant", "Sure:\n\n```sh\necho hi\n```\n")])
    bar = view.actions_bar
    view.anchorClicked.emit(QUrl("copy:1"))
    assert QGuiApplication.clipboard().text().startswith("Sure:")
    assert bar.copied_shown() and bar.copy_button.toolTip() == "Copied"  # the icon's name says it
    qtbot.waitUntil(lambda: not bar.copied_shown())
    view.anchorClicked.emit(QUrl("copycode:1.0"))
    assert QGuiApplication.clipboard().text() == "echo hi" and _link_texts(view, "copycode:1.0") == [chat_view.COPIED]
    qtbot.waitUntil(lambda: _link_texts(view, "copycode:1.0") == ["Copy"])


def test_a_messages_actions_show_as_icons_under_the_pointer(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    view.set_messages([MessageView("user", "Hello there"), MessageView("assistant", "Hi! How can I help?")])
    assert "Copy" not in view.toPlainText() and "You" not in view.toPlainText()  # no header of words
    frames = view.document().rootFrame().childFrames()
    user, reply = (view._frame_rect(f) for f in frames)
    assert user.left() > reply.left() and user.width() < reply.width()  # a bubble on the right, as wide as its text
    view._hover(reply.center().toPoint())
    bar = view.actions_bar
    assert bar.isVisible() and bar.index == 1 and bar.regenerate_button.isVisibleTo(bar)  # the last reply
    names = [b.accessibleName() for b in (bar.copy_button, bar.branch_button, bar.regenerate_button)]
    assert all(names) and names[0] == "Copy message"
    asked: list[int] = []
    view.branch_requested.connect(asked.append)
    bar.branch_button.click()
    assert asked == [1]
    view._hover(user.center().toPoint())
    assert bar.index == 0 and not bar.regenerate_button.isVisibleTo(bar)
    view.begin_reply()  # a reply still coming offers nothing yet
    assert not view.message_actions_for(2) and view.message_actions_for(1)


def test_a_streaming_code_blocks_last_line_stays_inside_the_block(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    view.add_user_message("Code please")
    view.begin_reply()
    view._last_render = 0.0  # this piece renders as Markdown at once
    view.append_reply("Here:\n\n```python\nprint(1)\n")
    view.append_reply("print(2)")  # between two renders
    body = view.toPlainText().split("Here:", 1)[1]
    assert "print(2)" not in body  # not as plain text under the block: it shows with the next render
    view._last_render = 0.0
    view.append_reply("\n")
    assert view.code_block("1.0") == "print(1)\nprint(2)"


def test_a_stray_closing_fence_closes_the_code_before_it() -> None:
    palette = Palette("#000000", "#666666", "#0000ff", "#eeeeee", "#cccccc", False)
    r = MarkdownRenderer()
    code = r.render("Here you go:\n\ndef add(a, b):\n    return a + b\n```\n", palette)
    assert code.code_blocks == ("def add(a, b):\n    return a + b",)  # its lines kept, and no empty block after
    assert r.render("Hello\n```", palette).code_blocks == ()
    assert r.render("```py\nx = 1\n```\nok", palette).code_blocks == ("x = 1",)
    assert r.render("```py\nx = 1", palette).code_blocks == ("x = 1",)  # still streaming: open to the end


def test_a_greeting_without_examples_offers_none(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    view.set_greeting("Loading the default model…", ())
    assert "Loading the default model" in view.toPlainText() and "try one of these" not in view.toPlainText()


def test_the_context_menu_offers_a_messages_actions(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    view.set_messages([MessageView("user", "Hello there"), MessageView("assistant", "Hi! How can I help?")])
    user, reply = (view._frame_rect(f).center().toPoint() for f in view.document().rootFrame().childFrames())
    texts = [a.text() for a in view.context_menu(reply).actions()]
    assert texts[-3:] == ["Copy Message", "Branch From Here", "Regenerate"]  # for the keyboard's menu key too
    assert [a.text() for a in view.context_menu(user).actions()][-2:] == ["Copy Message", "Branch From Here"]
