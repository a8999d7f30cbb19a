"""The chat view on its own: it follows a streaming reply unless the user scrolled up (then the "↓ New text" pill),
renders Markdown (inline code, highlighted code blocks with Copy, tables), collapses long pastes, and greets an
empty conversation with example prompts."""

from __future__ import annotations

from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication, QTextCharFormat

from app.window.chat_view import ChatView
from app.worker.types import MessageView


def _view(qtbot) -> ChatView:  # type: ignore[no-untyped-def]
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(700, 400)
    view.show()
    qtbot.waitExposed(view)
    return view


def _stream(view: ChatView, lines: int) -> None:
    for i in range(lines):
        view.append_reply(f"line {i} of a long reply\n")


def test_follows_the_stream_until_the_user_scrolls_up(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = _view(qtbot)
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
    view = _view(qtbot)
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


def test_streamed_reply_is_rendered_when_it_ends(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = _view(qtbot)
    view.add_user_message("Code please")
    view.begin_reply()
    for piece in ["Here: `x", " = 1`", "\n\n```sh\necho hi\n", "```\n"]:
        view.append_reply(piece)
    view.end_reply()
    assert "`" not in view.toPlainText()
    assert view.reply_text() == "Here: `x = 1`\n\n```sh\necho hi\n```\n"  # Copy gives the Markdown as written


def test_a_long_paste_is_collapsed_until_show_all(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = _view(qtbot)
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
    view = _view(qtbot)
    view.set_greeting("Ready.", ["What is the capital of France?", "Write a haiku."])
    view.set_messages([])
    assert "Ready." in view.toPlainText() and "Write a haiku." in view.toPlainText()
    chosen: list[str] = []
    view.example_chosen.connect(chosen.append)
    view.anchorClicked.emit(QUrl("example:1"))
    assert chosen == ["Write a haiku."]
    view.add_user_message("Hello")
    assert "Ready." not in view.toPlainText()  # the greeting goes with the first message


def test_a_tool_result_shows_folded_under_the_reply_that_called_it(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = _view(qtbot)
    long = "x" * 1000
    result = '<tool_response>\n{"name": "demo__add", "content": "' + long + '"}\n</tool_response>'
    view.set_messages(
        [
            MessageView("user", "Add 1 and 2."),
            MessageView("assistant", "Calling the tool."),
            MessageView("user", result),
            MessageView("assistant", "It is 3."),
        ]
    )
    text = view.toPlainText()
    assert "<tool_response>" not in text and "Tool demo__add → xxx" in text
    assert long not in text  # folded: the chat shows the start of it, the model had it whole
    assert text.index("Calling the tool.") < text.index("Tool demo__add") < text.index("It is 3.")
