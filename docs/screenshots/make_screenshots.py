"""Render the app's states to PNGs in this folder, under a real X server, at 1440×900 and 900×700, in light and
dark mode.

    xvfb-run -a -s "-screen 0 1920x1080x24" python docs/screenshots/make_screenshots.py [--model DIR|FILE.gguf]
        [--sizes 1440x900 ...] [--schemes light dark]

Scratch settings and data (nothing of the user's is touched); the model really runs, so the states show real
numbers, except the streaming code block, whose text is fed to the chat view as a reply would stream it (the default
model rarely writes code). The whole screen is grabbed, so menus and popups appear as a user sees them.

States: empty, chat, reading, inspector-details, conversation-sampling, model-menu, search, code-streaming, copied,
json-on and json-off (one conversation replies as JSON, the other does not), handed-over (a second launch handed a
.spark to the running app); once, at the first size: get-models (cards), -downloading, -downloaded and a chat with
the downloaded model.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from PySide6.QtCore import QEventLoop, QSettings, QTimer
from PySide6.QtWidgets import QApplication

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from app.application import SparkApplication
from app.misc.signal_wait import wait_any
from app.misc.standarddirs import StandardDirs
from app.misc.theme import Scheme
from app.models.dialog import GetModelsDialog
from app.settings.preferences import Preferences
from app.window.main_window import MainWindow
from app.wiring import build_main_window
from engine import GenerationSettings, SamplingSettings

WAIT_MS = 600_000
LONG = (
    "Here are my notes from the week. " + "We met the suppliers, compared the offers line by line and agreed to "
    "decide on Friday after the samples arrive. "
) * 40


def pump(ms: int) -> None:
    loop = QEventLoop()
    QTimer.singleShot(ms, loop.quit)
    loop.exec()


SIZES = ((1440, 900), (900, 700))
SCHEME = [Scheme.LIGHT]  # the one being shot


def shoot(window: MainWindow, name: str, size: tuple[int, int]) -> None:
    pump(300)
    screen = QApplication.primaryScreen()
    g = window.frameGeometry()
    image = screen.grabWindow(0, g.x(), g.y(), size[0], size[1])
    out = HERE / f"{name}-{SCHEME[0].value}-{size[0]}x{size[1]}.png"
    image.save(str(out))
    print(f"wrote {out.relative_to(ROOT)}")


def say(window: MainWindow, text: str) -> None:
    sent: list[bool] = []
    name, _ = wait_any({"finished": window.client.finished}, WAIT_MS, lambda: sent.append(window.submit(text)))
    assert sent == [True] and name == "finished", (sent, name, window.notice.text())


def build(model: Path | None, workdir: Path, size: tuple[int, int]) -> MainWindow:
    prefs = Preferences(QSettings(str(workdir / "settings.ini"), QSettings.Format.IniFormat))
    # The model's own sampling defaults (what a user gets), seeded so the shots are the same run to run.
    prefs.set_generation(GenerationSettings(max_tokens=200, sampling=SamplingSettings(seed=7)))
    dirs = StandardDirs(cache=workdir / "cache", data=workdir / "data", documents=workdir)
    dirs.ensure()
    window = build_main_window(prefs, dirs)
    window.resize(*size)
    window.move(0, 0)
    window.show()
    name, value = wait_any(
        {"loaded": window.client.loaded, "error": window.client.error},
        WAIT_MS,
        lambda: window.load_model(model, "auto"),
    )
    assert name == "loaded", value
    if window.state.opening is not None:  # a relaunch reopens the last conversation first
        wait_any({"restored": window.client.restored, "error": window.client.error}, WAIT_MS)
    return window


def states(window: MainWindow, size: tuple[int, int], first: bool) -> None:
    window.menus.new_chat_action.trigger()
    shoot(window, "empty", size)
    if first:
        for q in ("What is the capital of France?", "Give me three tips for a good night's sleep."):
            say(window, q)
            window.menus.new_chat_action.trigger()
        say(window, "Write a haiku about autumn leaves.")
    else:
        window.open_conversation(window.sidebar.ids()[0])
        wait_any({"restored": window.client.restored, "error": window.client.error}, WAIT_MS)
    shoot(window, "chat", size)

    # Reading a long prompt: grabbed while the reading is under way.
    grabbed: list[bool] = []

    def on_reading(p: object) -> None:
        if not grabbed and getattr(p, "done", 0) > 0 and p.done < p.total:  # type: ignore[attr-defined]
            grabbed.append(True)
            shoot(window, "reading", size)
            window.client.stop()

    chat_id = window.state.current_id
    window.menus.new_chat_action.trigger()  # read in a chat of its own, gone again after the shot
    window.client.reading.connect(on_reading)
    say(window, LONG)
    window.client.reading.disconnect(on_reading)
    window.commands.delete(window.state.current_id)
    window.notice.hide()
    window.open_conversation(chat_id)
    wait_any({"restored": window.client.restored, "error": window.client.error}, WAIT_MS)

    window.menus.inspector_action.setChecked(True)
    window.inspector.details_button.setChecked(True)
    shoot(window, "inspector-details", size)
    window.inspector.details_button.setChecked(False)

    def sampling_sheet() -> None:  # Chat ▸ Sampling for This Conversation…, shot and cancelled
        shoot(window, "conversation-sampling", size)
        sheet = QApplication.activeModalWidget()
        if sheet is not None:
            sheet.close()

    QTimer.singleShot(400, sampling_sheet)
    window.menus.conversation_sampling_action.trigger()

    QTimer.singleShot(400, lambda: (shoot(window, "model-menu", size), window.menus.model_menu.close()))
    window.menus.model_button.showMenu()

    window.sidebar.search.setText("haiku")
    shoot(window, "search", size)
    window.sidebar.search.setText("")

    extra_states(window, size)


CODE_REPLY = (
    "Here is a function that adds two numbers:\n\n```python\ndef add(a: int, b: int) -> int:\n"
    '    """The sum of a and b."""\n    return a + b\n\n\nprint(add(2, 3))\n'
)


def extra_states(window: MainWindow, size: tuple[int, int]) -> None:
    """Code streaming, Copy's answer, JSON on in one conversation and off in another, a second launch's file."""
    from app.misc.single_instance import InstanceServer, hand_over, socket_path

    chat = window.chat
    window.menus.new_chat_action.trigger()
    chat.add_user_message("Write a Python function that adds two numbers.")
    chat.begin_reply()
    for k in range(0, len(CODE_REPLY), 12):  # as a reply streams: pieces, renders between them
        chat._last_render = 0.0 if k % 48 == 0 else chat._last_render
        chat.append_reply(CODE_REPLY[k : k + 12])
    shoot(window, "code-streaming", size)
    chat.end_reply("", 1)

    frames = chat.document().rootFrame().childFrames()
    point = chat._frame_rect(frames[-1]).center().toPoint()
    chat._hover(point)
    chat.actions_bar.copy_button.click()
    shoot(window, "copied", size)
    chat.actions_bar.hide()

    plain_id = window.sidebar.ids()[0]
    window.menus.new_chat_action.trigger()
    json_id = window.state.current_id
    window.library.set_reply_schema(
        window.state.current_id, '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
    )
    window.show_reply_json()
    say(window, "Which city is the Eiffel Tower in?")
    window.menus.model_menu.close()
    shoot(window, "json-on", size)
    window.open_conversation(plain_id)
    wait_any({"restored": window.client.restored, "error": window.client.error}, WAIT_MS)
    shoot(window, "json-off", size)

    talk = Path(window.dirs.documents) / "from-a-friend.spark"
    window.client.save(talk)
    wait_any({"saved": window.client.saved, "error": window.client.error}, WAIT_MS)
    window.menus.new_chat_action.trigger()
    server = InstanceServer(socket_path(window.dirs.cache / f"shots-{size[0]}"))
    server.listen()
    from app.__main__ import bring_forward

    server.files_requested.connect(lambda files: bring_forward(window, files))
    took: list[bool] = []
    import threading

    threading.Thread(target=lambda: took.append(hand_over(server.path, [talk])), daemon=True).start()
    wait_any({"restored": window.client.restored, "error": window.client.error}, WAIT_MS)
    shoot(window, "handed-over", size)
    server.close()
    for _ in range(200):  # until the opened copy is stored in the history, so it can go again
        if window.library.get(window.state.current_id) is not None:
            break
        pump(50)
    for cid in (json_id, window.state.current_id):  # the next size starts from the same history
        window.commands.delete(cid)
    window.notice.hide()


def get_models(window: MainWindow, size: tuple[int, int]) -> None:
    """Model ▸ Get Models… against the tests' loopback Hub serving the default model's GGUF as the catalog's
    SmolLM2 file: the recommendations, a download held halfway, the downloaded model, and a chat with it."""
    from engine.loading.model_files import default_model_path
    from tests.helpers.fake_hub import FakeHub

    data = default_model_path().read_bytes()
    hub = FakeHub().start()
    repo, file = "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"
    hub.add(repo, {file: data}).files[file].hold_after = len(data) // 2
    os.environ["HF_ENDPOINT"] = hub.endpoint
    try:
        window.menus.get_models_action.trigger()
        dialog = window.get_models_dialog
        assert isinstance(dialog, GetModelsDialog)
        dialog.move(window.frameGeometry().center() - dialog.rect().center())
        shoot(window, "get-models", size)
        dialog.start_download(repo, file)
        for _ in range(600):  # until the held half has arrived
            pump(50)
            if dialog.bar.value() >= 450:
                break
        shoot(window, "get-models-downloading", size)
        wait_any({"downloaded": dialog.tasks.downloaded, "failed": dialog.tasks.failed}, WAIT_MS, hub.release)
        shoot(window, "get-models-downloaded", size)
        name, value = wait_any(
            {"loaded": window.client.loaded, "error": window.client.error}, WAIT_MS, dialog.use_button.click
        )
        assert name == "loaded", value
        if window.state.opening is not None:  # the open conversation is carried over to the new model first
            wait_any({"restored": window.client.restored, "error": window.client.error}, WAIT_MS)
        window.menus.new_chat_action.trigger()
        say(window, "What is the capital of France?")
        shoot(window, "downloaded-model-chat", size)
        window.commands.delete(window.state.current_id)  # the other sizes' history stays as the first one's
        window.notice.hide()
    finally:
        hub.stop()
        os.environ.pop("HF_ENDPOINT", None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, default=None, help="default: the default model")
    p.add_argument("--sizes", nargs="*", default=[f"{w}x{h}" for w, h in SIZES], help="e.g. 1440x900")
    p.add_argument("--schemes", nargs="*", default=["light", "dark"], choices=["light", "dark"])
    p.add_argument("--no-get-models", action="store_true", help="leave out the Get Models… states")
    args = p.parse_args()
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes]
    os.environ.setdefault("QT_QPA_PLATFORM", "xcb")
    app = SparkApplication([sys.argv[0]])
    with tempfile.TemporaryDirectory(prefix="spark-shots-") as tmp:
        first = True
        for scheme in (Scheme(s) for s in args.schemes):
            app.set_scheme(scheme)
            SCHEME[0] = scheme
            for size in sizes:  # type: ignore[assignment]
                window = build(args.model, Path(tmp), size)
                states(window, size, first=first)
                if first and not args.no_get_models:
                    get_models(window, size)
                first = False
                window.shutdown()
                window.close()
    app.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
