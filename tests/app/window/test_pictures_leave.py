"""Pictures leaving the local model's path, as a user meets them with the tiny random SmolVLM / Idefics3 model: Export
writes a conversation's picture beside its Markdown (or inside it, or in its JSON) and says where; a conversation with
a picture moved to a server whose model sees images sends the picture with the next turn and keeps it in the stored
file; moved to any other server, the next turn is refused in one sentence and nothing is sent. "Add a Server…" asks
whether the model sees images (its Check ticks it where the server says) and remembers the answer.

With SPARK_SHOTS set to a folder, the export's result and the remote turns are grabbed there."""

from __future__ import annotations

import base64
import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QFileDialog, QTreeView

from app.history.export import PICTURES_SUFFIX
from app.settings.remote_servers import AddServerDialog, RemoteServerList
from app.window.dialogs import MARKDOWN_PICTURE_FILTERS
from app.window.main_window import MainWindow
from engine import IMAGE_TOKEN, GenerationSettings, RemoteServer, SamplingSettings, load_session
from engine.openai.client import CANNOT_SEE_IMAGES
from tests.helpers.app_window import WAIT_MS, ScriptedDialogs, say, set_reply_tokens, shot, show_window
from tests.helpers.http_clients import closed_after_test
from tests.helpers.pictures import png
from tests.helpers.server import KEY, Served, start_server

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The window fixture's model, here one that sees images."""
    from tests.helpers.tiny_idefics3 import make_tiny_idefics3

    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def vision_served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start_server(tiny_model, tmp_path_factory.mktemp("kv"), vision=True)
    yield s
    s.server.stop()


@pytest.fixture
def shown(qtbot, window: MainWindow) -> MainWindow:  # type: ignore[no-untyped-def]
    return show_window(qtbot, window)


def listing_shot(qtbot, folder: Path, name: str, selected: str, filters: list[str]) -> None:  # type: ignore[no-untyped-def]
    """The export panel on `folder`, `selected` chosen, as a user sees the result of an export in it (Qt's own
    panel: the platform's cannot be grabbed)."""
    if not os.environ.get("SPARK_SHOTS"):
        return
    panel = QFileDialog(None, "Export", str(folder))
    panel.setOption(QFileDialog.Option.DontUseNativeDialog)
    panel.setAcceptMode(QFileDialog.AcceptMode.AcceptSave)
    panel.setNameFilters(filters)
    panel.setViewMode(QFileDialog.ViewMode.Detail)
    panel.resize(900, 420)
    panel.show()
    qtbot.waitExposed(panel)
    qtbot.wait(800)  # the panel lists the folder on a thread of its own
    panel.selectFile(str(folder / selected))
    for view in panel.findChildren(QTreeView):
        for column in range(4):
            view.resizeColumnToContents(column)
    shot(panel, name)
    panel.close()
    panel.deleteLater()


def served_reply(client: openai.OpenAI, messages: list[Any], sampling: SamplingSettings) -> Any:
    """The server's own reply to `messages`, sampled as the window samples (8 tokens, its seed)."""
    return client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
    )


def with_picture(qtbot, gui, window: MainWindow, data: bytes, text: str):  # type: ignore[no-untyped-def]
    """Send `text` with the picture `data` as the paperclip would; returns the turn's result."""
    from engine import decode_bytes

    window.composer.attachments.add_picture(decode_bytes(data), "photo.png")
    return say(qtbot, gui, window, text)


def test_export_writes_the_picture_beside_the_markdown_inside_it_or_in_the_json_and_says_where(
    qtbot, shown: MainWindow, gui, dialogs: ScriptedDialogs, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    window = shown
    data = png(40, 28, seed=21)
    result = with_picture(qtbot, gui, window, data, "What is in this picture?")
    assert result.reason != "error"
    out = tmp_path / "exports"
    out.mkdir()
    dialogs.export_to = out / "Look.md"
    window.menus.export_md_action.trigger()
    folder = out / f"Look{PICTURES_SUFFIX}"
    (file,) = folder.iterdir()
    assert file.read_bytes() == data and file.suffix == ".png" and len(file.stem) == 12
    md = (out / "Look.md").read_text()
    assert "![picture](Look%20pictures/" + file.name + ")" in md and IMAGE_TOKEN not in md
    assert window.notice.text() == "Exported Look.md, its 1 picture in “Look pictures”."
    shot(window, "picture-export-notice.png")

    dialogs.export_inline = True
    dialogs.export_to = out / "One file.md"
    window.menus.export_md_action.trigger()
    inline = (out / "One file.md").read_text()
    assert "![picture](data:image/png;base64," + base64.b64encode(data).decode() + ")" in inline
    assert not (out / f"One file{PICTURES_SUFFIX}").exists() and window.notice.text() == "Exported One file.md."

    dialogs.export_to = out / "Look.json"
    window.menus.export_json_action.trigger()
    exported = json.loads((out / "Look.json").read_text())
    (image,) = exported["images"]
    assert base64.b64decode(image["data"]) == data and image["media_type"] == "image/png"
    assert exported["messages"][0]["content"][0] == {"type": "image", "sha256": image["sha256"]}
    listing_shot(qtbot, out, "picture-export-dialog-listing.png", "Look.md", list(MARKDOWN_PICTURE_FILTERS))
    listing_shot(qtbot, folder, "picture-export-pictures-folder.png", file.name, ["All files (*)"])


def test_a_conversation_with_a_picture_goes_on_with_a_server_that_sees_images(
    qtbot, shown: MainWindow, gui, dialogs: ScriptedDialogs, prefs, vision_served: Served
) -> None:  # type: ignore[no-untyped-def]
    window = shown
    data = png(36, 24, seed=22)
    with_picture(qtbot, gui, window, data, "What is this?")
    set_reply_tokens(prefs, 8)  # seeded sampling: the tiny random model's greedy reply is special tokens alone
    dialogs.server_to_add = RemoteServer(vision_served.url, "tiny", KEY, sees_images=True)
    with qtbot.waitSignal(gui(window.client.remote_ready), timeout=WAIT_MS):
        window.menus.add_server_action.trigger()
    conversation: Any = window.client.worker.conversation
    before = [dict(m) for m in conversation.remote.messages]
    assert before[0]["content"] == f"{IMAGE_TOKEN}What is this?"
    result = say(qtbot, gui, window, "And its colours?")
    assert result.reason != "error" and result.text
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    sent: list[Any] = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}],
        },
        before[1],
        {"role": "user", "content": "And its colours?"},
    ]
    client = closed_after_test(openai.OpenAI(base_url=vision_served.url, api_key=KEY, max_retries=0))
    sampling = prefs.generation().sampling
    want = served_reply(client, sent, sampling)
    assert result.text == want.choices[0].message.content  # the same reply: the server read the same prompt
    assert want.usage is not None and result.progress.prompt_tokens == want.usage.prompt_tokens
    assert window.chat.picture_keys() == ["0.0"]  # the bubble keeps its thumbnail on the server too
    stored = load_session(window.library.path_for(window.state.current_id))
    assert [p.data for p in stored.images] == [data]  # the transcript's file keeps the picture
    # A picture given while the server is the model goes with its message, as the paperclip gives it.
    second = png(20, 20, seed=24)
    again = with_picture(qtbot, gui, window, second, "And this one?")
    assert again.reason != "error"
    assert window.chat.picture_keys() == ["0.0", "4.0"]
    url2 = "data:image/png;base64," + base64.b64encode(second).decode()
    sent += [
        {"role": "assistant", "content": result.text},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url2}}, {"type": "text", "text": "And this one?"}],
        },
    ]
    want = served_reply(client, sent, sampling)
    assert want.usage is not None and again.progress.prompt_tokens == want.usage.prompt_tokens
    assert again.text == want.choices[0].message.content
    stored = load_session(window.library.path_for(window.state.current_id))
    assert [p.data for p in stored.images] == [data, second]
    shot(window, "picture-remote-server-sent.png")


def test_a_server_whose_model_cannot_see_refuses_the_next_turn_and_nothing_is_sent(
    qtbot, shown: MainWindow, gui
) -> None:  # type: ignore[no-untyped-def]
    window = shown
    with_picture(qtbot, gui, window, png(30, 30, seed=23), "What is this?")
    server = RemoteServer("http://127.0.0.1:9/v1", "text-model")  # never contacted: the refusal comes first
    with qtbot.waitSignal(gui(window.client.remote_ready), timeout=WAIT_MS):
        window.client.use_remote(server)
    window.composer.prompt.setPlainText("And now?")
    window.composer.send_button.click()
    assert window.notice.text() == CANNOT_SEE_IMAGES  # the window refuses: nothing went to the server
    assert window.composer.prompt.toPlainText() == "And now?"  # the user's words stay in the box
    shot(window, "picture-remote-server-refused.png")
    # The worker refuses as well, should a request get there (not "cannot reach": it never tries).
    with qtbot.waitSignal(gui(window.client.error), timeout=WAIT_MS) as blocker:
        window.client.send("And now?", GenerationSettings(max_tokens=4))
    assert blocker.args[0] == CANNOT_SEE_IMAGES
    assert [m["role"] for m in window.client.worker.conversation.remote.messages] == ["user", "assistant"]  # type: ignore[union-attr]
    assert window.chat.picture_keys() == ["0.0"]


def test_add_a_server_asks_whether_it_sees_images_and_the_list_remembers(qtbot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    dialog = AddServerDialog()
    qtbot.addWidget(dialog)
    dialog.url.setText("http://127.0.0.1:8000/v1")
    dialog.model.setEditText("vlm")
    assert not dialog.sees_images.isChecked()  # the user's word: nothing is assumed
    dialog.sees_images.setChecked(True)
    dialog.accept()
    server = dialog.value()
    assert server == RemoteServer("http://127.0.0.1:8000/v1", "vlm", sees_images=True)
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    servers = RemoteServerList(settings)
    servers.add(server)
    servers.add(RemoteServer("http://127.0.0.1:8000/v1", "text"))
    assert [(s.model, s.sees_images) for s in servers.all()] == [("vlm", True), ("text", False)]
    settings.setValue("remote/servers", json.dumps([{"base_url": "http://h:1/v1", "model": "m", "sees_images": "yes"}]))
    assert [s.sees_images for s in servers.all()] == [False]  # only a JSON true says yes


class LlamaCppLike(http.server.BaseHTTPRequestHandler):
    """A loopback server that lists one model and says, as llama.cpp's /props does, that it sees images."""

    def do_GET(self) -> None:  # http.server's name for it
        answers = {"/v1/models": {"data": [{"id": "vlm"}]}, "/props": {"modalities": {"vision": True}}}
        body = json.dumps(answers.get(self.path, {})).encode()
        self.send_response(200 if self.path in answers else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_check_ticks_sees_images_where_the_server_says_its_model_does(qtbot) -> None:  # type: ignore[no-untyped-def]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), LlamaCppLike)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dialog = AddServerDialog()
        qtbot.addWidget(dialog)
        dialog.url.setText(f"http://127.0.0.1:{server.server_address[1]}/v1")
        dialog.check.click()
        qtbot.waitUntil(dialog.sees_images.isChecked, timeout=WAIT_MS)
        assert dialog.model.currentText() == "vlm"
        assert dialog.status.text() == "The server offers 1 model. It says vlm sees images."
    finally:
        server.shutdown()
        server.server_close()
