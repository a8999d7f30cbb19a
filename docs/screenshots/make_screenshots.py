"""Render the app's main states to PNGs in this folder, under a real X server, at 1440×900, 900×700 and 1920×1080,
in light and dark mode.

    xvfb-run -a -s "-screen 0 1920x1080x24" python docs/screenshots/make_screenshots.py [--model DIR|FILE.gguf]

Scratch settings and data (nothing of the user's is touched); the model really runs, so the states show real
numbers. The whole screen is grabbed, so menus and popups appear as a user sees them.
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


SIZES = ((1440, 900), (900, 700), (1920, 1080))
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
    finally:
        hub.stop()
        os.environ.pop("HF_ENDPOINT", None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, default=None, help="default: the default model")
    args = p.parse_args()
    os.environ.setdefault("QT_QPA_PLATFORM", "xcb")
    app = SparkApplication([sys.argv[0]])
    with tempfile.TemporaryDirectory(prefix="spark-shots-") as tmp:
        first = True
        for scheme in (Scheme.LIGHT, Scheme.DARK):
            app.set_scheme(scheme)
            SCHEME[0] = scheme
            for size in SIZES:
                window = build(args.model, Path(tmp), size)
                states(window, size, first=first)
                if first:
                    get_models(window, size)
                first = False
                window.shutdown()
                window.close()
    app.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
