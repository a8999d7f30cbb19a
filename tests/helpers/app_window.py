"""Shared pieces of the app tests: scripted dialogs and thermal source, the reply length they use, and how a test
ends a window (its worker threads first). The fixtures in tests/app/conftest.py build on these."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QEvent
from PySide6.QtWidgets import QWidget

from app.history.export import ExportForm
from app.misc.signal_wait import GuiRelay
from app.settings.conversation_sampling import SamplingEdit
from app.settings.preferences import Preferences, default_generation
from app.settings.sampling_choice import SamplingChoice
from app.settings.settings_dialog import EditedSettings
from app.tools.consent import Decision, PendingCall
from app.tools.mcp_host import McpServerSpec
from app.window.chat_view import ChatView
from app.window.dialogs import Dialogs
from app.window.main_window import MainWindow
from app.wiring import build_main_window
from app.worker.client import ConversationClient
from app.worker.types import LoadedModel
from engine import GenerationSettings, ModelSampling, RemoteServer, SamplingSettings
from engine.hw import ThermalReading, ThermalState

WAIT_MS = 30_000
REPLY_TOKENS = 12  # every streamed reply in these tests; long ones set their own


@dataclass
class ScriptedDialogs(Dialogs):
    """Answers the window's questions from the test's script and records what was asked."""

    confirm_answer: bool = True
    save_to: Path | None = None
    open_from: Path | None = None
    model_from: Path | None = None
    new_settings: GenerationSettings | None = None
    new_use_model_defaults: bool | None = None  # None: Settings keeps the switch as it was shown
    conversation_sampling: SamplingEdit | None = None  # the Sampling sheet's answer (None: cancelled)
    answer_text: str | None = None
    export_to: Path | None = None
    export_inline: bool = False  # Markdown's "pictures inside the file" form
    server_to_add: RemoteServer | None = None
    new_tool_servers: list[McpServerSpec] | None = None  # None: Settings keeps the servers it was shown
    tool_decisions: list[Decision] = field(default_factory=list)  # answers to "Run a Tool?" in turn (then Deny)
    schema: str | None = None  # what the "Reply as JSON" schema dialog returns (None: cancelled)
    asked: list[str] = field(default_factory=list)
    save_starts: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(None)

    def confirm(self, title: str, text: str, accept: str) -> bool:
        self.asked.append(text)
        return self.confirm_answer

    def save_path(self, start: Path) -> Path | None:
        self.asked.append("save")
        self.save_starts.append(start)
        return self.save_to

    def export_path(self, start: Path, kind: str, pictures: bool = False) -> tuple[Path, ExportForm] | None:
        self.asked.append(f"export {start}")
        form = ExportForm.MARKDOWN_INLINE if kind == "md" and self.export_inline else ExportForm(kind)
        return None if self.export_to is None else (self.export_to, form)

    def ask_text(self, title: str, label: str, current: str) -> str | None:
        self.asked.append(title)
        return self.answer_text

    def model_file(self, start: Path) -> Path | None:
        self.asked.append("model file")
        return self.model_from

    def about(self) -> None:
        self.asked.append("about")

    def help(self, keys: list[tuple[str, str]]) -> None:
        self.asked.append("help")
        self.help_keys = keys

    def open_path(self, start: Path) -> Path | None:
        self.asked.append("open")
        return self.open_from

    def model_dir(self, start: Path) -> Path | None:
        self.asked.append("model")
        return self.model_from

    def add_server(self) -> RemoteServer | None:
        self.asked.append("add server")
        return self.server_to_add

    def edit_settings(
        self,
        current: GenerationSettings,
        use_model_defaults: bool,
        server: tuple[object, object] | None = None,
        tool_servers: list[McpServerSpec] | None = None,
        model_defaults: ModelSampling | None = None,
    ) -> EditedSettings | None:
        self.asked.append("settings")
        if self.new_settings is None:
            return None
        servers = self.new_tool_servers if self.new_tool_servers is not None else tool_servers or []
        flag = use_model_defaults if self.new_use_model_defaults is None else self.new_use_model_defaults
        return EditedSettings(self.new_settings, flag, servers)

    def edit_conversation_sampling(
        self, current: SamplingChoice | None, app: SamplingChoice, model_defaults: ModelSampling | None
    ) -> SamplingEdit | None:
        self.asked.append("conversation sampling")
        return self.conversation_sampling

    def ask_tool_consent(self, call: PendingCall) -> Decision:
        self.asked.append(f"tool {call.server} {call.tool}")
        return self.tool_decisions.pop(0) if self.tool_decisions else Decision.DENY

    def edit_schema(self, current: str) -> str | None:
        self.asked.append("schema")
        return self.schema


class ScriptedThermal:
    """A thermal source whose state the test sets; like macOS's notification, a change tells the subscribers."""

    def __init__(self) -> None:
        self.state = ThermalState.NOMINAL
        self._listeners: list[Callable[[], None]] = []

    def read(self) -> ThermalReading:
        return ThermalReading(self.state, "test sensor", 42.0, "cpu")

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def change(self, state: ThermalState) -> None:
        self.state = state
        for listener in list(self._listeners):
            listener()


def dispose(w: MainWindow) -> None:
    """End the worker threads, then destroy the window and collect its Python cycles here, on the GUI thread.

    Otherwise the cyclic garbage collector may free the old window's wrappers later on a worker thread (a later
    test's generation loop), and PySide's deferred deletion of those widgets crashes.
    """
    w.shutdown()
    w.close()
    w.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    gc.collect()


def set_reply_tokens(prefs: Preferences, n: int) -> None:
    """Replies of `n` tokens at the user's own sampling (not the model's defaults: the tiny random model's loop
    guard pushes it onto its template's special tokens, which a transcript does not show)."""
    prefs.set_generation(
        replace(default_generation(), max_tokens=n, sampling=SamplingSettings(seed=0, temperature=0.8))
    )


@contextmanager
def running_client(qtbot, cache: Path, model: Path, backend: str = "cpu") -> Iterator[ConversationClient]:  # type: ignore[no-untyped-def]
    """A conversation client with `model` loaded on its worker; shut down and deleted after the block."""
    gc.collect()  # earlier tests' Qt wrappers go here, on the GUI thread, not later on this worker's
    client = ConversationClient("test-worker", None, cache, store=True)  # the main chat's kind: it reports reading
    try:
        with qtbot.waitSignal(client.loaded, timeout=300_000) as blocker:
            client.load(model, backend)
        assert isinstance(blocker.args[0], LoadedModel)
        yield client
    finally:
        assert client.shutdown()
        client.deleteLater()
        QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
        gc.collect()


def say(qtbot, gui, window: MainWindow, text: str):  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS) as blocker:
        assert window.submit(text)
    return blocker.args[0]


def relaunch(qtbot, prefs, dirs, dialogs, tiny_model: Path, seen: list[str]) -> MainWindow:  # type: ignore[no-untyped-def]
    """A new window over the same settings and data folder, as the next launch of the app would build it."""
    again = build_main_window(prefs, dirs, dialogs)
    for name in ("conversation_shown", "restored"):
        getattr(again.client, name).connect(lambda _v, name=name: seen.append(name))
    with qtbot.waitSignal(GuiRelay(again.client.restored, parent=again).fired, timeout=WAIT_MS):
        again.load_model(tiny_model, "cpu")
    return again


def shown_chat_view(qtbot) -> ChatView:  # type: ignore[no-untyped-def]
    """A chat view on its own, 700 × 400, exposed."""
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(700, 400)
    view.show()
    qtbot.waitExposed(view)
    return view


def show_window(qtbot, window: MainWindow) -> MainWindow:  # type: ignore[no-untyped-def]
    """`window` shown, at the size the pictures tests grab it, once exposed."""
    window.resize(900, 640)
    window.show()
    qtbot.waitExposed(window)
    return window


def shot(widget: QWidget, name: str) -> None:
    """With SPARK_SHOTS set to a folder, `widget` grabbed there as the PNG `name`."""
    folder = os.environ.get("SPARK_SHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        assert widget.grab().save(str(Path(folder) / name), "PNG")
