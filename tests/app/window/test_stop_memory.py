"""After a Stop, in whichever phase it lands, the conversation's memory holds exactly what the transcript says: its
tokens are the transcript's (the prompt's part read so far, or the prompt and the reply so far), its running
digest is theirs, every one of them has its KV in a slot, and the count the window reports is theirs."""

from __future__ import annotations

import hashlib

from PySide6.QtCore import QTimer

from app.window.main_window import MainWindow
from app.worker.conversation import LocalConversation
from app.worker.types import MemoryReport, ReadProgress, TurnResult
from engine.memory.cascade import CascadeMemory
from engine.memory.cascade.prefix import token_bytes
from engine.session.engine import Session
from tests.helpers.app_window import WAIT_MS, set_reply_tokens

# Long enough that reading it takes many chunks on the tiny model, past its cascade's window.
LONG_PROMPT = "Summarise this: " + "the keeper logs the weather, the ships and the lamp. " * 150


def session_of(window: MainWindow) -> Session:
    conversation = window.client.worker.conversation
    assert isinstance(conversation, LocalConversation)
    return conversation.session


def without_bos(session: Session, text: str) -> str:
    """`text` less a leading BOS (the template writes one, or the tokenizer adds it)."""
    bos = session.tokenizer.bos_id
    return text.removeprefix(session.tokenizer.decode([bos], skip_special=False)) if bos is not None else text


def rendered_prompt(session: Session, messages: int) -> str:
    """The chat template over the first `messages` messages, as the model reads it before replying."""
    msgs = [m.as_template_dict() for m in session.messages[:messages]]
    return without_bos(session, session.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))


def memory_text(session: Session, tokens: list[int]) -> str:
    return without_bos(session, session.tokenizer.decode(tokens, skip_special=False))


def assert_memory_is_its_tokens(session: Session, reported: MemoryReport, result: TurnResult) -> None:
    memory = session.memory
    assert isinstance(memory, CascadeMemory)
    held = len(memory.tokens)
    assert reported.tokens == result.memory_tokens == held  # what the window says is what the memory holds
    assert memory.prefix.hasher.hexdigest() == hashlib.sha256(token_bytes(memory.tokens)).hexdigest()
    w = memory.working
    assert w.n_sink + w.n_window + w.evicted == held  # each token has its slot (or left the window), no more


def test_stop_while_reading_leaves_the_memory_holding_the_part_read(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 50)
    reports: list[MemoryReport] = []
    gui(window.client.memory).connect(reports.append)

    def on_reading(p: ReadProgress) -> None:
        if 0 < p.done < p.total:  # Stop clicked while the prompt is read: it lands anywhere, mid-forward mostly
            window.stop_reply()

    reading = gui(window.client.reading)
    reading.connect(on_reading)
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        QTimer.singleShot(0, lambda: window.submit(LONG_PROMPT))
    result: TurnResult = blocker.args[0]
    assert result.reason == "cancelled" and result.progress.generated_tokens == 0

    session = session_of(window)
    assert [m.role for m in session.messages] == ["user"]  # the question stays, no reply
    prompt = rendered_prompt(session, 1)
    read = memory_text(session, session.memory.tokens)
    assert 0 < len(read) < len(prompt) and prompt.startswith(read)  # the memory holds the part read, exactly
    assert_memory_is_its_tokens(session, reports[-1], result)
    assert "Stopped while reading" in window.chat.toPlainText()

    # The next message reads the rest first: the memory then holds the whole transcript.
    reading.disconnect(on_reading)
    set_reply_tokens(prefs, 4)
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        window.submit("Thanks")
    assert blocker.args[0].reason in ("stop", "length")
    reply = session.messages[-1].content
    assert memory_text(session, [*session.memory.tokens, *session._pending()]) == rendered_prompt(session, 2) + reply


def test_stop_while_writing_leaves_the_memory_holding_the_reply_so_far(qtbot, window: MainWindow, gui, prefs) -> None:  # type: ignore[no-untyped-def]
    set_reply_tokens(prefs, 400)
    reports: list[MemoryReport] = []
    gui(window.client.memory).connect(reports.append)
    with qtbot.waitSignal(window.coalescer.flushed, timeout=WAIT_MS):
        window.submit("Tell me a long story")
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        window.stop_reply()
    result: TurnResult = blocker.args[0]
    assert result.reason == "cancelled" and result.progress.generated_tokens > 0

    session = session_of(window)
    reply = session.messages[-1].content
    assert window.chat.reply_text() == reply == result.text  # the transcript shows the reply so far
    # The memory holds the prompt and every reply token but the last, which is fed first next turn.
    held = memory_text(session, [*session.memory.tokens, *session._pending()])
    assert held == rendered_prompt(session, 1) + reply
    assert_memory_is_its_tokens(session, reports[-1], result)
