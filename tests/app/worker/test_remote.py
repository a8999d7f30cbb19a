"""The app's remote backend against our own server (engine.openai) on loopback: "Add a Server…" makes it a model
choice, replies stream from it, Stop works, the inspector says memory does not apply, the conversation is stored as
its transcript and reopens with a local model, and a server that fails is one sentence with nothing lost."""

from __future__ import annotations

import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from PySide6.QtCore import Qt, QUrl

from app.misc.signal_wait import GuiRelay
from app.window.main_window import MainWindow
from app.wiring import build_main_window
from app.worker.types import TurnResult
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.openai.client import RemoteServer
from engine.session.file import TRANSCRIPT_KIND, load_session
from tests.helpers.app_window import WAIT_MS, ScriptedDialogs, dispose
from tests.helpers.http_clients import closed_after_test
from tests.helpers.server import KEY, Served, start_server


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from tests.helpers.tiny import make_tiny_model

    s = start_server(make_tiny_model(tmp_path_factory.mktemp("remote-tiny"), layers=2), tmp_path_factory.mktemp("kv"))
    yield s
    s.server.stop()


def greedy(prefs, n: int = 12) -> None:  # type: ignore[no-untyped-def]
    prefs.set_generation(GenerationSettings(max_tokens=n, sampling=SamplingSettings(greedy=True)))


def choose(qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs, server: RemoteServer) -> None:  # type: ignore[no-untyped-def]
    """Add the server through the model menu's "Add a Server…", which also chooses it."""
    dialogs.server_to_add = server
    with qtbot.waitSignal(gui(window.client.remote_ready), timeout=WAIT_MS):
        window.menus.add_server_action.trigger()


def send(qtbot, window: MainWindow, gui, text: str) -> TurnResult:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        assert window.submit(text)
    return blocker.args[0]


def test_a_remote_server_is_a_model_choice_and_the_reply_streams_from_it(
    qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs, prefs, served: Served, tiny_model: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    greedy(prefs)
    window.system_prompt.setText("Be brief.")
    window.system_prompt.editingFinished.emit()
    server = RemoteServer(served.url, "tiny", KEY)
    choose(qtbot, window, gui, dialogs, server)
    assert window.state.remote == server and window.remote_servers.all() == [server]
    window.menus.model_menu.aboutToShow.emit()
    checked = [a.text() for a in window.menus.model_menu.actions() if a.isChecked()]
    assert checked == [f"tiny on {served.url.split('//')[1].split('/')[0]}"]  # the server, not the local model
    assert window.menus.model_button.text() == "Model: tiny"

    result = send(qtbot, window, gui, "The quick brown fox")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
    want = closed_after_test(openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0)).chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    assert result.reason == want.choices[0].finish_reason
    assert result.text == want.choices[0].message.content and result.text
    assert window.chat.reply_text() == result.text
    assert result.progress.generated_tokens == want.usage.completion_tokens  # type: ignore[union-attr]

    # The cascade and memory sections say plainly that they do not apply.
    assert window.inspector.memory.body.text().startswith("Does not apply to a remote model")
    assert "does not apply to a remote model" in window.inspector.cache_panel._empty.text()
    assert window.inspector.memory_panel.cache.text() == "does not apply (remote model)"
    assert served.url in window.inspector.model.body.text()

    # Stored as the transcript only: no memory, no token ids.
    cid = window.state.current_id
    stored = load_session(window.library.path_for(cid))
    assert stored.memory_meta.get("kind") == TRANSCRIPT_KIND and not stored.token_ids and not stored.tensors
    assert [(m.role, m.content) for m in stored.messages] == [
        ("user", "The quick brown fox"),
        ("assistant", result.text),
    ]
    assert stored.system_prompt == "Be brief."
    entry = window.library.get(cid)
    assert entry is not None and entry.model.startswith("tiny on 127.0.0.1:")
    elsewhere = tmp_path / "remote chat.spark"
    shutil.copyfile(window.library.path_for(cid), elsewhere)

    # Back to a local model: the conversation goes on there as a transcript (re-read on the next message) ...
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.load_model(tiny_model, "cpu")
    assert window.state.remote is None and "Does not apply" not in window.inspector.memory.body.text()
    assert "The quick brown fox" in window.chat.toPlainText() and window.chat.reply_text() == result.text.replace(
        "\r", "\n"
    )
    nxt = send(qtbot, window, gui, "And then?")  # the local model reads the transcript and answers
    assert nxt.reason in ("stop", "length")
    assert [m.role for m in load_session(window.library.path_for(cid)).messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    # A remote conversation's file opened with the local model restores its transcript without asking anything:
    # it holds no memory that taking the transcript alone could lose.
    window.menus.new_chat_action.trigger()
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_file(elsewhere)
    assert window.state.current_id != cid and window.chat.reply_text() == result.text
    assert "The quick brown fox" in window.chat.toPlainText() and "And then?" not in window.chat.toPlainText()
    assert dialogs.asked == ["add server"]


def test_stop_ends_a_remote_reply(
    qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs, prefs, served: Served
) -> None:  # type: ignore[no-untyped-def]
    greedy(prefs, 200)
    choose(qtbot, window, gui, dialogs, RemoteServer(served.url, "tiny", KEY))
    after_stop: list[str] = []
    stopped = threading.Event()

    def on_delta(text: str) -> None:  # on the worker thread (direct connection): counts exactly
        if stopped.is_set():
            after_stop.append(text)
        else:
            stopped.set()
            window.client.stop()

    window.client.worker.delta.connect(on_delta, Qt.ConnectionType.DirectConnection)
    result = send(qtbot, window, gui, "Tell me a long story")
    assert result.reason == "cancelled" and not after_stop
    assert result.progress.generated_tokens == 1
    assert "Stopped." in window.chat.toPlainText() and window.send_button.text() == "Send"
    stored = load_session(window.library.path_for(window.state.current_id))
    assert [(m.role, m.content) for m in stored.messages] == [
        ("user", "Tell me a long story"),
        ("assistant", result.text),
    ]
    qtbot.waitUntil(
        lambda: served.service.metrics.reasons.get("cancelled", 0) > 0, timeout=WAIT_MS
    )  # the server let go too


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "case, words",
    [("down", "Cannot reach the server"), ("key", "refused the API key")],
)
def test_a_failing_server_is_one_sentence_and_nothing_is_lost(
    qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs, served: Served, case: str, words: str
) -> None:  # type: ignore[no-untyped-def]
    server = {
        "down": RemoteServer(f"http://127.0.0.1:{_closed_port()}/v1", "tiny", KEY),
        "key": RemoteServer(served.url, "tiny", "sk-wrong"),
    }[case]  # (any model name is served by the server's loaded model: tests/engine/openai/test_remote.py)
    choose(qtbot, window, gui, dialogs, server)
    with qtbot.waitSignal(gui(window.client.error), timeout=WAIT_MS) as blocker:
        window.submit("Are you there?")
    message = blocker.args[0]
    assert words in message and message.count(". ") == 0 and message.endswith((".", "?")) and "Traceback" not in message
    qtbot.waitUntil(lambda: not window.client.busy, timeout=WAIT_MS)
    assert window.notice.text() == message
    assert "Are you there?" in window.chat.toPlainText()  # the user's message stays on screen and in the library
    stored = load_session(window.library.path_for(window.state.current_id))
    assert [(m.role, m.content) for m in stored.messages] == [("user", "Are you there?")]


def test_the_open_conversation_goes_on_at_the_server_and_the_history_opens_there(
    qtbot, window: MainWindow, gui, dialogs: ScriptedDialogs, prefs, served: Served, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    greedy(prefs)
    local = send(qtbot, window, gui, "Hello")  # a local conversation first
    local_id = window.state.current_id
    choose(qtbot, window, gui, dialogs, RemoteServer(served.url, "tiny", KEY))
    history = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": local.text},
        {"role": "user", "content": "Go on"},
    ]
    client = closed_after_test(openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0))
    want = client.chat.completions.create(model="tiny", messages=history, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert (
        send(qtbot, window, gui, "Go on").text == want.choices[0].message.content
    )  # the server got the whole transcript
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        window.menus.regenerate_action.trigger()
    assert blocker.args[0].text == want.choices[0].message.content and window.chat.toPlainText().count("Go on") == 1
    assert [m.role for m in load_session(window.library.path_for(local_id)).messages] == ["user", "assistant"] * 2

    # Save a Copy writes the transcript (there is no memory of ours to save).
    dialogs.save_to = tmp_path / "copy.spark"
    with qtbot.waitSignal(gui(window.client.saved), timeout=WAIT_MS):
        window.menus.save_action.trigger()
    assert load_session(dialogs.save_to).memory_meta.get("kind") == TRANSCRIPT_KIND

    # A new chat, then the earlier conversation from the history: its transcript comes back, still at the server.
    window.menus.new_chat_action.trigger()
    send(qtbot, window, gui, "Another chat")
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS):
        window.open_conversation(local_id)
    assert (
        window.state.current_id == local_id
        and "Go on" in window.chat.toPlainText()
        and "Another chat" not in window.chat.toPlainText()
    )
    assert window.state.remote is not None and window.inspector.memory.body.text().startswith("Does not apply")
    third = send(qtbot, window, gui, "More")
    assert third.reason in ("stop", "length") and third.text
    assert [m.role for m in load_session(window.library.path_for(local_id)).messages] == ["user", "assistant"] * 3
    # Branch at the first reply: a new conversation holding the transcript up to there, stored transcript-only.
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        window.chat._on_anchor(QUrl("branch:1"))
    assert window.state.current_id != local_id and "Go on" not in window.chat.toPlainText()
    qtbot.waitUntil(lambda: window.library.get(window.state.current_id) is not None, timeout=WAIT_MS)
    branch = load_session(window.library.path_for(window.state.current_id))
    assert branch.memory_meta.get("kind") == TRANSCRIPT_KIND
    assert [(m.role, m.content) for m in branch.messages] == [("user", "Hello"), ("assistant", local.text)]


def test_a_server_chosen_while_the_local_model_loads_keeps_the_choice(
    qtbot, tiny_model: Path, prefs, dirs, dialogs: ScriptedDialogs, thermal, served: Served
) -> None:  # type: ignore[no-untyped-def]
    greedy(prefs)
    window = build_main_window(prefs, dirs, dialogs, thermal)
    try:
        server = RemoteServer(served.url, "tiny", KEY)
        with qtbot.waitSignal(GuiRelay(window.client.remote_ready, parent=window).fired, timeout=WAIT_MS):
            window.load_model(tiny_model, "cpu")  # the app's startup load, still running when the server is chosen
            window.use_remote(server)
        with qtbot.waitSignal(GuiRelay(window.client.finished, parent=window).fired, timeout=WAIT_MS) as blocker:
            assert window.submit("Hi")
        assert window.state.remote == server and blocker.args[0].text
        assert load_session(window.library.path_for(window.state.current_id)).memory_meta.get("kind") == TRANSCRIPT_KIND
    finally:
        dispose(window)


def test_the_next_launch_goes_back_to_the_server_and_its_conversation(
    qtbot, window: MainWindow, gui, prefs, dirs, dialogs: ScriptedDialogs, thermal, served: Served, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    greedy(prefs)
    server = RemoteServer(served.url, "tiny", KEY)
    choose(qtbot, window, gui, dialogs, server)
    first = send(qtbot, window, gui, "Remember me")
    cid = window.state.current_id
    window.shutdown()
    again = build_main_window(prefs, dirs, dialogs, thermal)
    try:
        with qtbot.waitSignal(GuiRelay(again.client.restored, parent=again).fired, timeout=WAIT_MS):
            again.load_model(tiny_model, "cpu")  # the startup load; then the server is chosen again
        assert again.state.remote == server and again.state.current_id == cid
        assert again.chat.reply_text() == first.text
        assert again.inspector.memory.body.text().startswith("Does not apply")
        # Choosing a local model ends it, for this launch and the next.
        with qtbot.waitSignal(GuiRelay(again.client.loaded, parent=again).fired, timeout=WAIT_MS):
            again.load_model(tiny_model, "cpu")
        assert again.state.remote is None and prefs.last_remote() is None
    finally:
        dispose(again)
