"""The main window: history sidebar | chat | inspector, the status bar, drops and opens, and its reactions to the
conversation client's signals.

It owns no engine state: requests go to the ConversationClient, results come back as its signals. Every conversation
lives in the library (the worker stores it after each change), so quitting, closing, New Chat or opening another
file never asks about unsaved work, and Undo (New Chat, Delete) reopens the stored conversation with its memory.
The menus (`app.window.menus`) and the conversation commands (`app.window.commands`) are helpers with a narrow
interface: they share the small `WindowState` and speak through signals; neither holds the window.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QEvent, Qt, QTimer, QUrl, Slot
from PySide6.QtGui import QCloseEvent, QDragEnterEvent, QDropEvent, QGuiApplication, QResizeEvent
from PySide6.QtWidgets import (
    QApplication,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.application import SparkApplication
from app.history.library import ConversationLibrary, file_origin, new_id
from app.history.sidebar import HistorySidebar
from app.inspector.hw_monitor import HardwareMonitor
from app.inspector.inspector import Inspector
from app.misc.coalescer import TextCoalescer
from app.misc.standarddirs import StandardDirs
from app.misc.words import counted
from app.models import FIRST_LAUNCH_HINT, downloaded_models, open_get_models
from app.server.local_server import LocalServerController, local_server_actions
from app.settings.json_reply import schema_grammar
from app.settings.preferences import Preferences
from app.settings.remote_servers import RemoteServerList
from app.settings.sampling_choice import ResolvedSampling, SamplingChoice, resolve, resolved_words
from app.tools.consent import ConsentRequest
from app.tray.quick_prompt import QuickPromptPanel
from app.window.chat_view import ChatView
from app.window.commands import ConversationCommands
from app.window.composer import Composer
from app.window.dialogs import Dialogs
from app.window.empty_state import greeting
from app.window.memory_controls import AttachmentRecord, MemoryControls
from app.window.menus import WindowMenus, shortcut_text
from app.window.notice_bar import NoticeBar
from app.window.state import Notice, WindowState
from app.window.think_switch import ThinkSwitch
from app.worker.client import ConversationClient
from app.worker.types import (
    LoadedModel,
    MessageView,
    ReadProgress,
    SessionFileEvent,
    StoredConversation,
    TurnProgress,
    TurnResult,
    remote_name,
)
from engine import (
    SESSION_SUFFIX,
    FinishReason,
    GenerationSettings,
    GrammarError,
    ModelSampling,
    RemoteServer,
    SparkError,
    default_model_path,
)
from engine.paths import APP_NAME

# Tokens per forward while the user waits (see generation_settings): Stop is checked between layers, so a chunk
# costs Stop one layer of it; 128 read the default model's prompts ~1.3x faster than 32 (64: ~1.3x, 256: ~1.2x).
INTERACTIVE_PREFILL_CHUNK = 128
NARROW_WIDTH = 1100  # px: below it the inspector folds away so the chat keeps most of the window
SIDEBAR_WIDE, SIDEBAR_NARROW = 230, 190  # px: the sidebar's width above and below NARROW_WIDTH
MEASURED_TOKENS = 16  # a reply this long gives a decoding speed worth recommending models by
INSPECTOR_WIDTH = 280  # px: the inspector's width when it opens
RUNS_ON = {  # the status bar's words for where the model runs (the details are in the tooltip and the inspector)
    "coreml": "runs on the Neural Engine",
    "mlx": "runs on the Mac's graphics processor (MLX)",
    "mps": "runs on the Mac's graphics processor",
    "cuda": "runs on the graphics card",
    "cpu": "runs on the CPU",
}
FINISH_NOTES: dict[FinishReason | str, str] = {
    FinishReason.CANCELLED: "Stopped.",
    FinishReason.LENGTH: "Reached the reply length limit; Settings can raise it.",
    "error": "",
}


def is_model_path(path: Path) -> bool:
    return (path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.gguf")))) or (
        path.is_file() and path.suffix.lower() == ".gguf"
    )


class MainWindow(QMainWindow):
    def __init__(
        self,
        client: ConversationClient,
        quick_client: ConversationClient,
        monitor: HardwareMonitor,
        local_server: LocalServerController,
        prefs: Preferences,
        dirs: StandardDirs,
        dialogs: Dialogs | None = None,
        library: ConversationLibrary | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.monitor = monitor
        self.local_server = local_server
        self.prefs = prefs
        self.dirs = dirs
        self.dialogs = dialogs or Dialogs(self)
        self.library = library or ConversationLibrary(dirs.conversations)
        self.library.load()
        self.state = WindowState()
        self.remote_servers = RemoteServerList(prefs.settings)
        self.startup_id = prefs.last_conversation() if self.library.get(prefs.last_conversation()) else ""
        self._shut_down = False
        self.workers_done = False  # set by shutdown: both worker threads ended
        self._narrow = False
        self.auto_layout = False
        self.measured_decode: tuple[int, float] | None = None  # the local model's (weight bytes, tokens/s) here
        self._weight_bytes = 0

        self.setObjectName("mainWindow")
        self.setAcceptDrops(True)
        self.setUnifiedTitleAndToolBarOnMac(True)
        self._build_central()
        self.commands = ConversationCommands(self.state, self.library, client, self.dialogs, dirs.documents, self)
        self.menus = WindowMenus(
            self,
            self.state,
            prefs,
            self.remote_servers,
            self.dialogs,
            self.chat,
            self._window_menu_titles,
            lambda: downloaded_models(dirs.models),
        )
        self.get_models_dialog: QWidget | None = None
        self._build_status_bar()
        self.quick_panel = QuickPromptPanel(quick_client, self.generation_settings)
        self.quick_client = quick_client
        self._connect()
        self._connect_memory()
        self._restore_layout()
        self.sidebar.set_current(self.state.current_id)
        self.update_title()
        self.show_busy(False)
        self.show_reply_json()
        if self.library.load_error:
            self.notice.show_message(self.library.load_error, error=True)

    def _build_central(self) -> None:
        self.sidebar = HistorySidebar(self.library)
        column = QWidget()
        column.setObjectName("central")
        self.system_prompt = QLineEdit(self.prefs.system_prompt())
        self.system_prompt.setObjectName("systemPrompt")
        self.system_prompt.setPlaceholderText("System prompt (optional): how Spark should behave")
        self.system_prompt.setClearButtonEnabled(True)
        system_row = QWidget()
        system_row.setObjectName("systemRow")
        row = QHBoxLayout(system_row)
        row.setContentsMargins(16, 8, 16, 8)
        label = QLabel("System:")
        label.setObjectName("fieldLabel")
        row.addWidget(label)
        row.addWidget(self.system_prompt, 1)
        self.system_row = system_row
        self.chat = ChatView()
        self.chat.setAcceptDrops(False)  # drops belong to the window (sessions, models)
        self.coalescer = TextCoalescer(parent=self)
        self.composer = composer = Composer()
        self.prompt = composer.prompt
        self.send_button = composer.send_button
        layout = QVBoxLayout(column)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(system_row)
        layout.addWidget(_separator())
        layout.addWidget(self.chat, 1)
        layout.addWidget(_separator())
        layout.addWidget(composer)
        self.think_switch = ThinkSwitch()
        composer.add_control(self.think_switch)  # under the prompt, by the token count
        self.notice = NoticeBar(self.chat)  # over the chat's top, never over the System field
        self.inspector = Inspector()
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.setChildrenCollapsible(False)
        for w, stretch in ((self.sidebar, 0), (column, 1), (self.inspector, 0)):
            self.splitter.addWidget(w)
            self.splitter.setStretchFactor(self.splitter.indexOf(w), stretch)
        self.sidebar.setMinimumWidth(180)
        self.inspector.setMinimumWidth(220)
        column.setMinimumWidth(360)
        self.setCentralWidget(self.splitter)

    def resizeEvent(self, event: QResizeEvent) -> None:
        """Below NARROW_WIDTH the chat keeps the room: the inspector folds away (⌘I still opens it) and comes back
        when the window is wide again, if the user had it open."""
        super().resizeEvent(event)
        self.composer.set_max_height(self.height() // 3)
        narrow = self.width() < NARROW_WIDTH
        if narrow != self._narrow:
            self._narrow = narrow
            self.auto_layout = True
            self.menus.inspector_action.setChecked(self.prefs.inspector_visible() and not narrow)
            self.auto_layout = False
            self._fit_sidebar()

    def _fit_sidebar(self) -> None:
        """The sidebar as wide as the window allows (a window made wide again gets back room for its titles); the
        chat column takes the difference."""
        sizes = self.splitter.sizes()
        side = SIDEBAR_NARROW if self._narrow else SIDEBAR_WIDE
        sizes[1] = max(0, sizes[1] + sizes[0] - side)
        sizes[0] = side
        if not self._narrow and self.inspector.isVisibleTo(self) and sizes[2] < INSPECTOR_WIDTH:
            # Shown again after a narrow spell: the splitter would hand it its minimum, cutting its text off.
            sizes[1] = max(0, sizes[1] + sizes[2] - INSPECTOR_WIDTH)
            sizes[2] = INSPECTOR_WIDTH
        self.splitter.setSizes(sizes)

    def _build_status_bar(self) -> None:
        status = self.statusBar()
        self.model_label = QLabel("No model")
        self.speed_label = QLabel()
        self.load_progress = QProgressBar()
        self.load_progress.setRange(0, 0)  # indeterminate: loading reports no fraction
        self.load_progress.setMaximumWidth(140)
        self.load_cancel = QPushButton("Cancel")
        self.load_cancel.setFlat(True)
        self.load_cancel.clicked.connect(self.client.cancel_load)
        status.addWidget(self.model_label, 1)
        status.addPermanentWidget(self.speed_label)
        status.addPermanentWidget(self.load_progress)
        status.addPermanentWidget(self.load_cancel)
        self.load_progress.hide()
        self.load_cancel.hide()
        self._loading_text = ""
        self._loading_since = 0.0
        self._loading_timer = QTimer(self)
        self._loading_timer.setInterval(1000)
        self._loading_timer.timeout.connect(self._tick_loading)
        self.server_label = QLabel()
        self.server_label.setObjectName("serverStatus")
        self.server_label.setTextFormat(Qt.TextFormat.RichText)
        self.server_label.linkActivated.connect(self._on_server_link)
        status.addPermanentWidget(self.server_label)
        self.server_label.hide()

    def _connect_memory(self) -> None:
        """Documents and earlier conversations as memory: chips, drops, recall, citations (app.window.memory_controls)."""
        self.memory_controls = MemoryControls(
            self,
            self.client,
            self.composer,
            self.chat,
            self.sidebar,
            self.library,
            lambda: self.state.opening or self.state.current_id,  # a restore in flight: the one it opens
            lambda text: self.notice.show_message(text, error=True),
            AttachmentRecord(self.dirs.data / "attachments.json"),
            self.dirs.documents,
            self.menus.chat_menu,
        )

    def _connect(self) -> None:
        c = self.client
        c.delta.connect(self.coalescer.push)
        c.reasoning.connect(self.chat.append_reasoning)
        c.progress.connect(self.inspector.on_progress)
        c.progress.connect(self._on_progress)
        c.memory.connect(self.inspector.on_memory)
        c.reading.connect(self.inspector.on_reading)
        c.memory.connect(self.monitor.on_memory)
        c.policy.connect(self.inspector.thermal_panel.on_decision)
        c.busy_changed.connect(self.show_busy)
        c.stopping.connect(self._on_stopping)
        c.loading.connect(self._on_loading)
        c.loaded.connect(self._on_loaded)
        c.load_cancelled.connect(self._on_load_cancelled)
        c.finished.connect(self._on_finished)
        c.error.connect(self._on_error)
        c.conversation_shown.connect(self._on_conversation)
        c.saved.connect(self._on_saved)
        c.restored.connect(self._on_restored)
        c.foreign_session.connect(self._on_foreign_session)
        c.system_prompt.connect(self._on_restored_system_prompt)
        c.reading.connect(self._on_reading)
        c.stored.connect(self._on_stored)
        c.remote_ready.connect(self._on_remote_ready)
        c.consent_needed.connect(self._on_consent_needed)
        self.coalescer.flushed.connect(self.chat.append_reply)
        self.monitor.sampled.connect(self.inspector.on_sample)
        self.prompt.submitted.connect(self.submit)
        self.send_button.clicked.connect(self._on_send_clicked)
        self.system_prompt.editingFinished.connect(self._on_system_prompt_edited)
        self.system_prompt.textChanged.connect(self._on_system_prompt_text)
        self.inspector.session_panel.save_requested.connect(self.commands.save)
        self.inspector.session_panel.restore_requested.connect(self.commands.open_session)
        self.chat.branch_requested.connect(self.commands.branch)
        self.chat.regenerate_requested.connect(self.regenerate)
        self.chat.example_chosen.connect(self.submit)
        self.sidebar.open_requested.connect(self.open_conversation)
        self.sidebar.renamed.connect(self.commands.rename)
        self.sidebar.duplicate_requested.connect(self.commands.duplicate)
        self.sidebar.delete_requested.connect(self.commands.delete)
        self.sidebar.export_requested.connect(self.commands.export)
        cmd = self.commands
        cmd.current_changed.connect(self._on_current_changed)
        cmd.chat_cleared.connect(self._clear_chat)
        cmd.history_changed.connect(self.sidebar.refresh)
        cmd.history_changed.connect(self.update_title)
        cmd.open_requested.connect(self.open_conversation)
        cmd.file_requested.connect(self.open_file)
        cmd.notice.connect(self.show_notice)
        cmd.undo_changed.connect(self._on_undo_changed)
        m = self.menus
        for action, slot in (
            (m.new_chat_action, cmd.new_chat),
            (m.open_action, cmd.open_session),
            (m.save_action, lambda: cmd.save()),
            (m.save_full_action, lambda: cmd.save(full_memory=True)),
            (m.export_md_action, lambda: cmd.export(self.state.current_id, "md")),
            (m.export_json_action, lambda: cmd.export(self.state.current_id, "json")),
            (m.close_action, self.close),
            (m.quit_action, self._on_quit),
            (m.undo_action, cmd.undo),
            (m.undo_action, self.notice.hide),  # the bar offering Undo goes once it is done
            (m.find_action, self.find_conversation),
            (m.rename_action, self.rename_current),
            (m.duplicate_action, lambda: cmd.duplicate(self.state.current_id)),
            (m.delete_action, lambda: cmd.delete(self.state.current_id)),
            (m.stop_action, self.stop_reply),
            (m.regenerate_action, self.regenerate),
            (m.quick_action, self.open_quick_prompt),
        ):
            action.triggered.connect(slot)
        for action, widget in (
            (m.sidebar_action, self.sidebar),
            (m.inspector_action, self.inspector),
            (m.system_prompt_action, self.system_row),
        ):
            widget.setVisible(action.isChecked())
            action.toggled.connect(widget.setVisible)
        m.inspector_action.toggled.connect(self._remember_inspector)
        m.model_chosen.connect(self.load_model)
        m.get_models_action.triggered.connect(self._on_get_models)
        m.model_path_chosen.connect(lambda path: self.handle_drop([path], 1))
        m.server_chosen.connect(self.use_remote)
        m.precision_changed.connect(self._on_precision)
        m.tool_servers_changed.connect(self._on_tool_servers)
        m.sampling_changed.connect(self.show_sampling)
        m.conversation_sampling_action.triggered.connect(self.edit_conversation_sampling)
        m.reply_json_toggled.connect(self.set_reply_json)
        m.appearance_chosen.connect(self._on_appearance)
        m.json_schema_requested.connect(self.edit_reply_schema)
        self.composer.json_chip.clicked.connect(lambda: self.set_reply_json(False))
        self.inspector.sampling_requested.connect(self.edit_conversation_sampling)
        self._on_tool_servers()
        m.conversation_chosen.connect(self.open_conversation)
        switch, copy = local_server_actions(self.local_server, self)
        self.server_switch, self.server_copy = switch, copy
        m.add_server_actions(switch, copy)
        c.loaded.connect(self.local_server.on_model_loaded)
        self.local_server.state_changed.connect(self._on_server_state)
        self.local_server.failed.connect(lambda text: self.notice.show_message(text, error=True))

    def _restore_layout(self) -> None:
        geometry = self.prefs.window_geometry()
        if geometry is None or not self.restoreGeometry(geometry):
            self.resize(1180, 760)
        state = self.prefs.window_state()
        if state is not None:
            self.restoreState(state)
        side = SIDEBAR_WIDE if self.width() >= NARROW_WIDTH else SIDEBAR_NARROW
        self.splitter.setSizes([side, max(400, self.width() - side - INSPECTOR_WIDTH), INSPECTOR_WIDTH])

    def load_model(self, model: Path | None, backend: str = "auto") -> None:
        if self.state.model_loaded and self.library.get(self.state.current_id):
            self.state.opening = (
                self.state.current_id
            )  # the worker carries it over to the new model: no sending until then
        self.client.load(model, backend, self.prefs.precision())

    def use_remote(self, server: RemoteServer) -> None:
        """Chat with `server` from now on; the open conversation goes on there as its transcript. (Requests are
        queued in order: a local model still loading finishes first, so the quick prompt keeps it, then this wins.)"""
        self.client.stop()
        self.client.use_remote(server)

    def open_conversation(self, conversation_id: str) -> None:
        """Switch to a stored conversation: its transcript and memory come back (recomputed where compact)."""
        if (
            not self.library.get(conversation_id)
            or conversation_id in (self.state.current_id, self.state.opening)
            or not self.state.model_loaded
        ):
            return
        self.client.stop()
        self.state.opening = conversation_id
        self.sidebar.set_current(conversation_id)  # selected at once; its words follow, then its memory
        path = self.library.path_for(conversation_id)
        self.client.restore(path, store_path=path)

    @Slot(str)
    def submit(self, text: str) -> bool:
        """Send `text` as the next user message; False (with a message saying why) when it cannot be sent now."""
        if not self.state.model_loaded:
            self.notice.show_message(
                "The model is still loading; your message is kept, send it when it is ready.", error=False
            )
            return False
        if self.state.opening is not None:
            self.notice.show_message(
                "Spark is still opening this conversation (recomputing its memory); your message is kept, send it in a moment.",
                error=False,
            )
            return False
        if self.client.busy:
            self.notice.show_message(
                f"Spark is still writing; your message is kept. Stop the reply ({shortcut_text(self.menus.stop_action)}) to send it now.",
                error=False,
                action=("Stop", self.stop_reply),
            )
            return False
        self.notice.hide()
        self.prompt.clear()
        self.chat.add_user_message(text)
        self.chat.begin_reply()
        self.chat.show_reading("Reading…")
        self.client.send(text, self.reply_settings())
        return True

    @Slot(Path)
    def open_file(self, path: Path) -> None:
        """A .spark file or a model from the command line, Finder/Dock, a drop or Open. The current conversation is
        already stored, so nothing is asked: an opened file becomes a new conversation in the history."""
        if is_model_path(path):
            self.load_model(path)
            return
        if path.suffix != SESSION_SUFFIX:
            self.notice.show_message(
                f"MLoT Spark opens {SESSION_SUFFIX} conversations, model folders and .gguf models; {path.name} is none of these, so nothing changed.",
                error=True,
            )
            return
        if not path.is_file():
            self.notice.show_message(f"The file {path.name} no longer exists; nothing changed.", error=True)
            return
        if not self.state.model_loaded or self.state.opening is not None:
            self.state.pending_files.append(path)  # opened once the model is ready (or the conversation opening now is)
            return
        known = self._in_history(path)
        if known is not None:  # already in the history: selected there, not copied into it again
            self.open_conversation(known)
            return
        self.client.stop()
        self.state.opening = new_id()
        self.library.set_origin(self.state.opening, file_origin(path))
        self.client.restore(path, store_path=self.library.path_for(self.state.opening))

    def _in_history(self, path: Path) -> str | None:
        """The history's conversation this file is: one of its own stored files, or a file opened before and
        unchanged since."""
        try:
            if path.resolve().parent == self.library.folder.resolve() and self.library.get(path.stem):
                return path.stem
            return self.library.find_origin(file_origin(path))
        except OSError:
            return None

    @Slot()
    def open_quick_prompt(self) -> None:
        self.quick_panel.open_centered()

    def shutdown(self, wait_ms: int = 30_000) -> bool:
        """Remember the layout and the open conversation, stop any reply, store it, end both worker threads (both
        at once, each within `wait_ms`); False when a worker is still busy then (a model still loading: nothing of
        it needs keeping, so Quit need not wait for it)."""
        if self._shut_down:
            return self.workers_done
        self._shut_down = True
        self.prefs.set_window(self.saveGeometry(), self.saveState())
        self.prefs.set_system_prompt(self.system_prompt.text().strip())
        self.prefs.set_last_conversation(self.state.current_id)
        self.prefs.sync()
        self.quick_panel.close()
        self.quick_client.begin_shutdown()
        self.client.begin_shutdown()  # Stop acts at once (between two tokens or two prompt chunks)
        self.local_server.stop()
        done = self.client.wait_shut_down(wait_ms)
        done = self.quick_client.wait_shut_down(wait_ms) and done
        QCoreApplication.sendPostedEvents(self.client, QEvent.Type.MetaCall)  # its last "stored" reaches the index
        self.library.close()
        self.workers_done = done
        return done

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        urls: list[QUrl] = event.mimeData().urls()
        event.acceptProposedAction()
        self.handle_drop([Path(u.toLocalFile()) for u in urls if u.isLocalFile()], len(urls))

    def handle_drop(self, paths: list[Path], count: int) -> None:
        if len(paths) != 1 or count != 1:
            self.notice.show_message(
                "Drop one .spark conversation, one model folder or one .gguf file at a time; nothing changed.",
                error=True,
            )
            return
        path = paths[0]
        if path.is_dir() and not is_model_path(path):
            self.notice.show_message(
                f"{path.name} is not a model folder (it has no config.json or .gguf); nothing changed.", error=True
            )
            return
        self.open_file(path)

    def closeEvent(self, event: QCloseEvent) -> None:
        # Nothing to ask: the conversation is stored as it changes (and once more on quit).
        self.prefs.set_window(self.saveGeometry(), self.saveState())
        self.prefs.set_last_conversation(self.state.current_id)
        super().closeEvent(event)

    @Slot()
    def _on_send_clicked(self) -> None:
        if self.client.busy:
            self.stop_reply()
            return
        text = self.prompt.toPlainText().strip()
        if text:
            self.submit(text)

    @Slot()
    def stop_reply(self) -> None:
        self.client.stop()

    @Slot()
    def regenerate(self) -> None:
        if not self.state.model_loaded or self.client.busy:
            return
        self.chat.remove_last_reply()
        self.chat.begin_reply()
        self.client.regenerate(self.reply_settings())

    @Slot()
    def _on_system_prompt_edited(self) -> None:
        self.client.set_system_prompt(self.system_prompt.text().strip())

    @Slot(str)
    def _on_system_prompt_text(self, text: str) -> None:
        self.prefs.set_system_prompt(text.strip())  # a cleared prompt stays cleared after a restart
        if not text:  # the clear button emits no editingFinished
            self.client.set_system_prompt("")

    @Slot(bool)
    def show_busy(self, busy: bool) -> None:
        self.menus.stop_action.setEnabled(busy)
        # Regenerate needs a prompt to answer again: not in an empty chat.
        self.menus.regenerate_action.setEnabled(self.state.model_loaded and not busy and not self.chat.is_empty())
        self.send_button.setText("Stop" if busy else "Send")
        self.send_button.setEnabled(self.state.model_loaded)
        if not busy:
            self.speed_label.setText("")

    def generation_settings(self, resolved: ResolvedSampling | None = None) -> GenerationSettings:
        """The user's settings with the sampling `resolved` (default: the app's choice, as the quick prompt uses), and
        the prompt read in chunks of at most INTERACTIVE_PREFILL_CHUNK: Stop (and Quit) acts between two layers of a
        chunk, so a long paste stops within one layer's time of a chunk."""
        settings = self.prefs.generation()
        sampling = (resolved or self.resolved_sampling(None)).sampling
        return replace(
            settings,
            sampling=sampling,
            prefill_chunk=min(settings.prefill_chunk, INTERACTIVE_PREFILL_CHUNK),
            think=self.think_switch.think(),
        )

    def resolved_sampling(self, override: SamplingChoice | None) -> ResolvedSampling:
        return resolve(self.prefs.sampling_choice(), override, self._model_sampling())

    def _model_sampling(self) -> ModelSampling | None:
        # A server's model samples as the user's values say: its own defaults are the server's business.
        return self.state.model_sampling if self.state.remote is None else None

    @Slot()
    def show_sampling(self) -> None:
        """The inspector says which settings the open conversation's replies use, and whose choice they are."""
        resolved = self.resolved_sampling(self.library.sampling_for(self.state.current_id))
        self.inspector.show_sampling(f"Replies use {resolved_words(resolved)}.")

    @Slot()
    def edit_conversation_sampling(self) -> None:
        cid = self.state.current_id
        edit = self.dialogs.edit_conversation_sampling(
            self.library.sampling_for(cid), self.prefs.sampling_choice(), self._model_sampling()
        )
        if edit is not None:
            self.library.set_sampling(cid, edit.choice)
            self.show_sampling()

    @Slot(bool)
    def set_reply_json(self, on: bool) -> None:
        """Reply as JSON, on or off in the open conversation only (kept with it in the library). Turned on where
        it has no schema yet: asked for one, starting from the last one given (cancelled: it stays off)."""
        cid = self.state.current_id
        schema = ""
        if on:
            schema = self.library.reply_schema(cid) or self._ask_schema(self.prefs.last_reply_schema())
        self.library.set_reply_schema(cid, schema)
        self.show_reply_json()

    @Slot()
    def edit_reply_schema(self) -> None:
        """Chat ▸ JSON Schema…: the open conversation's schema; accepting it turns Reply as JSON on there."""
        cid = self.state.current_id
        schema = self._ask_schema(self.library.reply_schema(cid) or self.prefs.last_reply_schema())
        if schema:
            self.library.set_reply_schema(cid, schema)
        self.show_reply_json()

    def _ask_schema(self, start: str) -> str:
        schema = self.dialogs.edit_schema(start) or ""
        if schema:
            self.prefs.set_last_reply_schema(schema)
        return schema

    def show_reply_json(self) -> None:
        """The menu's tick and the composer's "JSON replies" chip follow the open conversation."""
        on = bool(self.library.reply_schema(self.state.current_id))
        self.menus.reply_json_action.setChecked(on)
        self.composer.json_chip.setVisible(on)

    def reply_settings(self) -> GenerationSettings:
        """The main chat's settings: the user's, constrained to the "Reply as JSON" schema when that is on (a schema
        edited by hand into the settings file and refused by the engine is said, and the reply goes unconstrained).
        The conversation's own sampling, where it has one, wins over the app's; the inspector says which was used."""
        resolved = self.resolved_sampling(self.library.sampling_for(self.state.current_id))
        settings = self.generation_settings(resolved)
        self.inspector.show_sampling(f"The last reply used {resolved_words(resolved)}.")
        schema = self.library.reply_schema(self.state.current_id)
        if not schema:
            return settings
        try:
            return replace(settings, grammar=schema_grammar(schema))
        except GrammarError as exc:
            self.notice.show_message(f"Reply as JSON is off for this reply: {exc}", error=True)
            return settings

    def title(self) -> str:
        entry = self.library.get(self.state.current_id)
        return entry.title if entry else "New Chat"

    def update_title(self) -> None:
        self.setWindowTitle(f"{self.title()} — {APP_NAME}")
        self.setWindowFilePath(str(self.state.file) if self.state.file else "")

    # -- the client's signals -------------------------------------------------------------------------------------
    @Slot(str)
    def _on_loading(self, model_dir: str) -> None:
        """Say what is happening and how long it takes (the first load on a machine also builds its kernels)."""
        name = Path(model_dir).name if model_dir else "the default model"
        if self.prefs.loaded_once():
            self._loading_text = f"Loading {name}…"
        else:
            self._loading_text = (
                f"Preparing {name} for this computer: the first launch takes about a minute, later ones a few seconds."
            )
        self._loading_since = time.monotonic()
        self.model_label.setText(self._loading_text)
        if self.chat.is_empty():
            self.chat.set_greeting(self._loading_text, ())
        self.load_progress.show()
        self.load_cancel.show()
        self._loading_timer.start()

    @Slot()
    def _tick_loading(self) -> None:
        seconds = int(time.monotonic() - self._loading_since)
        self.model_label.setText(f"{self._loading_text} ({seconds} s)")

    @Slot(LoadedModel)
    def _on_loaded(self, loaded: LoadedModel) -> None:
        info = loaded.info
        first = not self.state.model_loaded
        self.state.model_loaded = True
        self.state.remote = None
        self._end_loading()
        resume = self._last_remote() if first else None
        self.state.model_path = None if _is_default(info.path) else info.path
        self.state.model_sampling = info.sampling
        if self._weight_bytes != info.weight_bytes:
            self.measured_decode = None  # another model: its speed is measured anew
        self._weight_bytes = info.weight_bytes
        self.model_label.setText(f"{info.name} · {RUNS_ON.get(info.backend, info.backend)}")
        self.model_label.setToolTip(f"{info.path}\n{info.backend_detail}")  # the expert's details, on hover
        self.chat.set_greeting(*greeting(info.name, info.weight_bytes))
        self.composer.set_counter(loaded.count_tokens, info.context_tokens)
        self.think_switch.set_model(loaded.engine.reasoning)
        self.menus.model_button.setText(f"Model: {info.name}")
        self.prefs.set_last_model(self.state.model_path)
        self.prefs.set_loaded_once()
        self.quick_client.attach(loaded.engine)
        self.client.set_system_prompt(self.system_prompt.text().strip())
        self.inspector.on_model(info)
        self.monitor.on_model(info)
        self.show_sampling()
        self.show_busy(self.client.busy)
        if resume is not None:  # the app was left chatting with a server: back to it (queued before the reopening)
            self.use_remote(resume)
        else:
            self.prefs.set_last_remote(None)
        if first:
            self._first_ready()

    def _last_remote(self) -> RemoteServer | None:
        last = self.prefs.last_remote()
        return next((s for s in self.remote_servers.all() if (s.url, s.model) == last), None)

    @Slot()
    def _on_get_models(self) -> None:
        self.get_models_dialog = open_get_models(self, self.dirs.models, self.load_model, self.measured_decode)

    def _first_ready(self) -> None:
        """The first model (local or remote) is ready: the chat gets its file, and the app reopens where it was."""
        self.client.new_chat(self.library.path_for(self.state.current_id))
        if not self.prefs.models_offer_shown():  # first launch: one line offering the model library
            self.prefs.set_models_offer_shown()
            get_models = ("Get Models…", self.menus.get_models_action.trigger)
            self.notice.show_message(FIRST_LAUNCH_HINT, error=False, action=get_models, stay=True)
        if (
            self.startup_id and not self.state.pending_files
        ):  # reopen where the user left off, unless a file was asked for
            self.open_conversation(self.startup_id)
        if self.state.pending_files:  # one at a time: each next one opens when the previous is restored
            self.open_file(self.state.pending_files.pop(0))

    @Slot(object)
    def _on_remote_ready(self, server: RemoteServer) -> None:
        first = not self.state.model_loaded
        self.state.model_loaded = True
        self.state.remote = server
        self.prefs.set_last_remote(server.url, server.model)
        self.model_label.setText(f"{remote_name(server)} · remote server")
        self.model_label.setToolTip(server.url)
        self.menus.model_button.setText(f"Model: {server.model}")
        self.inspector.show_remote(server)
        self.show_sampling()
        self.chat.set_greeting(*greeting(server.model, 0, remote=True))
        self.composer.set_counter(None, 0)
        self.show_busy(self.client.busy)
        if first:
            self._first_ready()

    @Slot()
    def _on_load_cancelled(self) -> None:
        self.state.opening = None
        self._end_loading()
        self.model_label.setText("Model loading cancelled")

    def _end_loading(self) -> None:
        self._loading_timer.stop()
        self.load_progress.hide()
        self.load_cancel.hide()

    @Slot(ReadProgress)
    def _on_reading(self, p: ReadProgress) -> None:
        rate = f" · {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else ""
        left = f" · about {p.seconds_left:,.0f} s left" if p.seconds_left >= 1 else ""
        if p.kind == "prompt":
            self.chat.show_reading(f"Reading {p.done:,} of {p.total:,} tokens{rate}{left}")
        elif p.done < p.total:
            self.notice.show_message(
                f"Recomputing this conversation's memory: {p.done:,} of {p.total:,} tokens{rate}{left}", error=False
            )

    @Slot(TurnProgress)
    def _on_progress(self, p: TurnProgress) -> None:
        if p.generated_tokens > 1:
            self.speed_label.setText(f"{p.tokens_per_s:.1f} tokens/s")

    @Slot(TurnResult)
    def _on_finished(self, result: TurnResult) -> None:
        if self._shut_down:  # Quit cut the reply off: the worker stored it with a note saying so
            return
        if self.state.remote is None and self._weight_bytes and result.progress.generated_tokens >= MEASURED_TOKENS:
            self.measured_decode = (self._weight_bytes, result.progress.tokens_per_s)  # Get Models… weighs speed by it
        self.coalescer.flush()  # text queued before `finished` is shown before the reply is closed
        notes = [FINISH_NOTES.get(result.reason, "")]
        if result.reason == FinishReason.CANCELLED and not result.progress.generated_tokens:
            notes = [
                "Stopped while reading; nothing was written. What was read stays in memory; the rest is read with your next message."
            ]
        if result.recalled_turns_ago:
            n = result.recalled_turns_ago
            notes.append(f"↺ Recalled from {counted(n, 'turn')} ago.")
        note = " ".join(n for n in notes if n)
        self.chat.end_reply(note, result.messages - 1 if result.messages else None)
        if note:  # kept with the conversation, so reopening it (Undo, relaunch) shows it again
            self.library.set_note(self.state.current_id, self.chat.last_index(), note)

    @Slot()
    def _on_tool_servers(self) -> None:
        self.client.set_tool_servers(self.prefs.tool_servers())

    @Slot(object)
    def _on_consent_needed(self, request: ConsentRequest) -> None:
        """A tool call waits for the user: asked in a dialog (the worker waits; this thread keeps running)."""
        request.answer(self.dialogs.ask_tool_consent(request.call))

    @Slot(str)
    def _on_error(self, message: str) -> None:
        self.notice.show_message(message, error=True)
        if self.state.opening is not None:
            self.state.opening = None
            self.sidebar.set_current(self.state.current_id)  # the conversation that stays open
        if self.state.pending_files and self.state.model_loaded:
            QTimer.singleShot(0, lambda: self.open_file(self.state.pending_files.pop(0)))
        if not self.state.model_loaded:
            self._end_loading()
            self.model_label.setText("No model loaded")

    @Slot(list)
    def _on_conversation(self, messages: list[MessageView]) -> None:
        self.coalescer.discard()
        entry = self.library.get(self.state.opening or self.state.current_id)
        self.chat.set_messages(messages, dict(entry.notes) if entry else None)
        self.inspector.show_transcript(sum(1 for m in messages if m.role == "assistant"))
        self.show_busy(self.client.busy)

    @Slot(StoredConversation)
    def _on_stored(self, stored: StoredConversation) -> None:
        cid = stored.path.stem
        if cid != self.state.current_id and self.library.get(cid) is None:
            return  # deleted (or left) before this store arrived
        self.library.record(cid, list(stored.messages), stored.model, stored.cut_off)
        title = self.state.titles_for_new.pop(cid, None)
        if title:
            self.library.rename(cid, title)
        self.sidebar.refresh()
        self.inspector.show_stored(f"Stored automatically ({counted(len(stored.messages), 'message')}).")
        self.update_title()

    @Slot(SessionFileEvent)
    def _on_saved(self, event: SessionFileEvent) -> None:
        self.state.file = event.path
        self.inspector.session_panel.on_file_event(event)
        self.notice.show_message(f"Saved a copy as {event.path.name}.", error=False)

    @Slot(SessionFileEvent)
    def _on_restored(self, event: SessionFileEvent) -> None:
        if self.state.opening:
            self.state.current_id = self.state.opening
            self.state.opening = None
        if self.state.pending_files:
            QTimer.singleShot(0, lambda: self.open_file(self.state.pending_files.pop(0)))
        in_library = event.path.parent == self.library.folder
        self.state.file = None if in_library else event.path
        self.inspector.session_panel.on_file_event(event)
        if not in_library or event.note:
            self.notice.show_message(
                f"Opened {event.path.name}" + (f" ({event.note})." if event.note else "."),
                error=bool(event.note) and "differs" in event.note,
            )
        elif self.notice.text().startswith("Recomputing"):
            self.notice.hide()
        self.sidebar.set_current(self.state.current_id)
        self.update_title()
        self.show_sampling()
        self.show_reply_json()

    @Slot(str, str)
    def _on_foreign_session(self, path: str, reason: str) -> None:
        if self.dialogs.confirm("Different Model", f"{reason}\n\nRestore the transcript only?", "Restore Transcript"):
            self.client.restore(
                Path(path), transcript_only=True, store_path=self.library.path_for(self.state.opening or new_id())
            )
        else:
            self.state.opening = None

    @Slot(str)
    def _on_restored_system_prompt(self, text: str) -> None:
        self.system_prompt.blockSignals(True)
        self.system_prompt.setText(text)
        self.system_prompt.blockSignals(False)

    # -- helpers' signals ----------------------------------------------------------------------------------------
    @Slot()
    def _on_current_changed(self) -> None:
        self.sidebar.set_current(self.state.current_id)
        self.update_title()
        self.show_sampling()
        self.show_reply_json()

    @Slot()
    def _clear_chat(self) -> None:
        """An empty conversation: the chat shows its greeting, and the panels forget the previous one."""
        self.coalescer.discard()
        self.chat.set_messages([])
        self.inspector.reset_conversation()
        self.speed_label.setText("")
        self.show_busy(self.client.busy)

    @Slot(Notice)
    def show_notice(self, notice: Notice) -> None:
        self.notice.show_message(notice.text, error=notice.error, action=notice.action)

    @Slot(str)
    def _on_undo_changed(self, label: str) -> None:
        self.menus.undo_action.setEnabled(bool(label))
        self.menus.undo_action.setText(f"Undo {label}" if label else "Undo")

    @Slot()
    def find_conversation(self) -> None:
        self.menus.sidebar_action.setChecked(True)
        self.sidebar.search.setFocus()
        self.sidebar.search.selectAll()

    @Slot()
    def rename_current(self) -> None:
        self.menus.sidebar_action.setChecked(True)
        if not self.sidebar.start_rename(self.state.current_id):
            self.notice.show_message(
                "This conversation has no messages yet, so there is nothing to rename.", error=False
            )

    def _remember_inspector(self, shown: bool) -> None:
        if not self.auto_layout:  # the user's choice, not the narrow-window rule
            self.prefs.set_inspector_visible(shown)

    @Slot(str)
    def _on_precision(self, _precision: str) -> None:
        if self.state.model_loaded and self.state.remote is None:  # a server's precision is its own business
            self.load_model(self.state.model_path)

    @Slot(bool, str)
    def _on_server_state(self, running: bool, url: str) -> None:
        """While the server is on, the status bar says where, with a link that copies the address."""
        link = self.palette().color(self.palette().ColorRole.Link).name()
        self.server_label.setText(
            f'Serving on {url} · <a style="color:{link}; text-decoration:none" href="copy">Copy</a>'
        )
        self.server_label.setVisible(running)

    @Slot(str)
    def _on_server_link(self, _href: str) -> None:
        QGuiApplication.clipboard().setText(self.local_server.url)
        self.notice.show_message(f"Copied {self.local_server.url}.", error=False)

    @Slot(str)
    def _on_appearance(self, choice: str) -> None:
        app = QApplication.instance()
        if isinstance(app, SparkApplication):
            app.set_appearance(choice)
        self.chat.restyle()  # its HTML holds the colours it was drawn with

    @Slot()
    def _on_quit(self) -> None:
        self.shutdown()
        QApplication.quit()

    def _window_menu_titles(self) -> list[tuple[str, str]]:
        return [(e.id, e.title) for e in self.library.entries()[:9]]

    @Slot()
    def _on_stopping(self) -> None:
        self.send_button.setText("Stopping…")
        self.send_button.setEnabled(False)
        self.chat.show_reading("Stopping…")


def _separator() -> QFrame:
    line = QFrame()
    line.setObjectName("separator")
    line.setFrameShape(QFrame.Shape.HLine)
    line.setFrameShadow(QFrame.Shadow.Plain)
    return line


def _is_default(path: Path) -> bool:
    try:
        return bool(path.resolve() == default_model_path().resolve())
    except (OSError, SparkError):  # not installed or damaged: nothing is the default
        return False
