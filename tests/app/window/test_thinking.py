"""A reasoning model's reply in the chat: its thinking streams into a "Thinking…" block above the answer, folds to
"Thought for N s" once the answer begins, opens and folds on a click, and Copy copies the answer only; the Think
switch shows for models whose template can switch their thinking."""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication

from app.window.chat_view import ChatView
from app.window.think_switch import ThinkSwitch
from engine.generation.reasoning import ReasoningStyle, Think
from engine.generation.reasoning import ThinkSwitch as Switch
from tests.helpers.app_window import shown_chat_view

THOUGHT = "The user greets me. A short, friendly answer will do."
ANSWER = "Hello! How can I help?"


def _shot(view: ChatView, name: str) -> None:
    """With SPARK_SCREENSHOTS=DIR, the view as it looks (for the review of how the block reads)."""
    folder = os.environ.get("SPARK_SCREENSHOTS")
    if folder:
        view.grab().save(str(Path(folder) / name))


def test_thinking_streams_folds_opens_and_copy_takes_the_answer_only(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    view.add_user_message("Hi")
    view.begin_reply()
    for word in THOUGHT.split(" "):
        view.append_reasoning(word + " ")
    shown = view.toPlainText()
    assert "Thinking…" in shown and "The" in shown  # the thought as it comes (renders are paced, the first at once)
    view.append_reply(ANSWER)
    view.end_reply()
    index = view.last_index()
    folded = view.toPlainText()
    assert "▸ Thought for 1 s" in folded and THOUGHT not in folded and ANSWER in folded
    assert folded.index("Thought for") < folded.index(ANSWER)  # above the answer
    _shot(view, "thinking-folded.png")
    view.anchorClicked.emit(QUrl(f"think:{index}"))
    opened = view.toPlainText()
    assert "▾ Thought for" in opened and THOUGHT in opened and opened.index(THOUGHT) < opened.index(ANSWER)
    _shot(view, "thinking-open.png")
    view.copy_message(index)
    assert QGuiApplication.clipboard().text() == ANSWER
    assert view.reply_text() == ANSWER
    view.anchorClicked.emit(QUrl(f"think:{index}"))
    assert THOUGHT not in view.toPlainText()


def test_a_reply_without_thinking_has_no_block_and_regenerate_drops_the_old_one(qtbot) -> None:  # type: ignore[no-untyped-def]
    view = shown_chat_view(qtbot)
    view.add_user_message("Hi")
    view.begin_reply()
    view.append_reasoning("hmm")
    view.append_reply(ANSWER)
    view.end_reply()
    view.remove_last_reply()
    view.begin_reply()
    view.append_reply(ANSWER)
    view.end_reply()
    assert "Thought" not in view.toPlainText() and "Thinking" not in view.toPlainText()


def test_the_think_switch_shows_for_models_that_can_switch(qtbot) -> None:  # type: ignore[no-untyped-def]
    switch = ThinkSwitch()
    qtbot.addWidget(switch)
    assert switch.think() is Think.AUTO  # hidden: the model's own default
    switch.set_model(ReasoningStyle(True, Switch.FLAG))
    assert not switch.isHidden() and switch.think() is Think.ON
    switch.setChecked(False)
    assert switch.think() is Think.OFF
    switch.set_model(ReasoningStyle(True, Switch.NONE))  # R1-style: always thinks, nothing to switch
    assert switch.isHidden() and switch.think() is Think.AUTO
