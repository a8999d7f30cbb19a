"""The main window: history sidebar | chat | inspector, the menus and shortcuts, the model picker, drops and opens.

It owns no engine state: requests go to the ConversationClient, results come back as signals. Every conversation
lives in the library (the worker stores it after each change), so quitting, closing, New Chat or opening another
file never asks about unsaved work, and Undo (New Chat, Delete) reopens the stored conversation with its memory.
The menus and actions (`window_menus`), the conversation commands (`conversation_commands`) and the reactions to
the worker (`window_events`) are modules of their own; the window holds the widgets and the state they share.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QCoreApplication, QEvent, Qt, QUrl, Slot
from PySide6.QtGui import QCloseEvent, QDragEnterEvent, QDropEvent, QResizeEvent
from PySide6.QtWidgets import (
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

from app.chat_view import ChatView, PromptEdit
from app.client import ConversationClient
from app.coalescer import TextCoalescer
from app.conversation_commands import ConversationCommands
from app.dialogs import Dialogs
from app.history import HistorySidebar
from app.hw_monitor import HardwareMonitor
from app.inspector import Inspector
from app.library import ConversationLibrary, new_id
from app.notice_bar import NoticeBar
from app.preferences import Preferences
from app.quick_prompt import QuickPromptPanel
from app.remote_servers import RemoteServerList
from app.standarddirs import StandardDirs
from app.window_events import WorkerEvents
from app.window_menus import WindowMenus, shortcut_text
from engine.generation.loop import GenerationSettings
from engine.openai.client import RemoteServer
from engine.paths import APP_NAME
from engine.session.file import SUFFIX as SESSION_SUFFIX

NARROW_WIDTH = 1100  # px: below it the inspector folds away so the chat keeps most of the window


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
        prefs: Preferences,
        dirs: StandardDirs,
        dialogs: Dialogs | None = None,
        library: ConversationLibrary | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.monitor = monitor
        self.prefs = prefs
        self.dirs = dirs
        self.dialogs = dialogs or Dialogs(self)
        self.library = library or ConversationLibrary(dirs.conversations)
        self.library.load()
        self.file: Path | None = None  # the file outside the library this conversation was last saved to / opened from
        self.current_id = new_id()
        self.model_loaded = False
        self.model_path: Path | None = None
        self.remote: RemoteServer | None = None  # the remote server replies stream from, when one is the model
        self.remote_servers = RemoteServerList(prefs.settings)
        self.opening: str | None = None  # the conversation id a restore in flight will become
        self.pending_files: list[Path] = []  # opened before the model was ready
        self.startup_id = prefs.last_conversation() if self.library.get(prefs.last_conversation()) else ""
        self.titles_for_new: dict[str, str] = {}  # branch/duplicate titles, applied when first stored
        self._shut_down = False
        self._narrow = False
        self.auto_layout = False

        self.setObjectName("mainWindow")
        self.setAcceptDrops(True)
        self.setUnifiedTitleAndToolBarOnMac(True)
        self._build_central()
        self.commands = ConversationCommands(self)
        self.menus = WindowMenus(self)
        self._build_status_bar()
        self.events = WorkerEvents(self)
        self.quick_panel = QuickPromptPanel(quick_client, self.generation_settings)
        self.quick_client = quick_client
        self._connect()
        self._restore_layout()
        self.sidebar.set_current(self.current_id)
        self.update_title()
        self.show_busy(False)
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
        self.prompt = PromptEdit()
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.setDefault(True)
        self.send_button.setMinimumWidth(76)
        composer = QWidget()
        composer.setObjectName("composer")
        bottom = QHBoxLayout(composer)
        bottom.setContentsMargins(16, 10, 16, 14)
        bottom.setSpacing(10)
        bottom.addWidget(self.prompt, 1)
        bottom.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        layout = QVBoxLayout(column)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(system_row)
        layout.addWidget(_separator())
        layout.addWidget(self.chat, 1)
        layout.addWidget(_separator())
        layout.addWidget(composer)
        self.notice = NoticeBar(column)
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
        narrow = self.width() < NARROW_WIDTH
        if narrow != self._narrow:
            self._narrow = narrow
            self.auto_layout = True
            self.menus.inspector_action.setChecked(self.prefs.inspector_visible() and not narrow)
            self.auto_layout = False

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

    def _connect(self) -> None:
        w = self.client.worker
        w.delta.connect(self.coalescer.push)
        w.progress.connect(self.inspector._on_progress)
        w.memory.connect(self.inspector._on_memory)
        w.memory.connect(self.monitor._on_memory)
        w.policy.connect(self.inspector.thermal_panel._on_decision)
        self.client.busy_changed.connect(self.show_busy)
        self.coalescer.flushed.connect(self.chat.append_reply)
        self.monitor.sampled.connect(self.inspector._on_sample)
        self.prompt.submitted.connect(self.submit)
        self.send_button.clicked.connect(self._on_send_clicked)
        self.system_prompt.editingFinished.connect(self._on_system_prompt_edited)
        self.system_prompt.textChanged.connect(self._on_system_prompt_text)
        self.inspector.session_panel.save_requested.connect(self.commands.save)
        self.inspector.session_panel.restore_requested.connect(self.commands.open_session)
        self.chat.branch_requested.connect(self.commands.branch)
        self.chat.copied.connect(lambda _: self.notice.show_message("Copied.", error=False))
        self.sidebar.open_requested.connect(self.open_conversation)
        self.sidebar.rename_requested.connect(self.commands.rename)
        self.sidebar.duplicate_requested.connect(self.commands.duplicate)
        self.sidebar.delete_requested.connect(self.commands.delete)
        self.sidebar.export_requested.connect(self.commands.export)

    def _restore_layout(self) -> None:
        geometry = self.prefs.window_geometry()
        if geometry is None or not self.restoreGeometry(geometry):
            self.resize(1180, 760)
        side = 230 if self.width() >= NARROW_WIDTH else 190
        self.splitter.setSizes([side, max(400, self.width() - side - 280), 280])

    def load_model(self, model: Path | None, backend: str = "auto") -> None:
        if self.model_loaded and self.library.get(self.current_id):
            self.opening = self.current_id  # the worker carries it over to the new model: no sending until then
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
            or conversation_id in (self.current_id, self.opening)
            or not self.model_loaded
        ):
            return
        self.client.stop()
        self.opening = conversation_id
        self.sidebar.set_current(conversation_id)  # selected at once; its words follow, then its memory
        path = self.library.path_for(conversation_id)
        self.client.restore(path, store_path=path)

    @Slot(str)
    def submit(self, text: str) -> bool:
        """Send `text` as the next user message; False (with a message saying why) when it cannot be sent now."""
        if not self.model_loaded:
            self.notice.show_message(
                "The model is still loading; your message is kept, send it when it is ready.", error=False
            )
            return False
        if self.opening is not None:
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
        self.client.send(text, self.generation_settings())
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
        if not self.model_loaded or self.opening is not None:
            self.pending_files.append(path)  # opened once the model is ready (or the conversation opening now is)
            return
        self.client.stop()
        self.opening = new_id()
        self.client.restore(path, store_path=self.library.path_for(self.opening))

    @Slot()
    def open_quick_prompt(self) -> None:
        self.quick_panel.open_centered()

    def shutdown(self) -> None:
        """Remember the layout and the open conversation, stop any reply, store it, end both worker threads."""
        if self._shut_down:
            return
        self._shut_down = True
        self.prefs.set_window(self.saveGeometry(), self.saveState())
        self.prefs.set_system_prompt(self.system_prompt.text().strip())
        self.prefs.set_last_conversation(self.current_id)
        self.prefs.sync()
        self.quick_panel.close()
        self.quick_client.shutdown()
        self.client.shutdown()
        QCoreApplication.sendPostedEvents(self, QEvent.Type.MetaCall)  # the worker's last "stored" reaches the index
        self.library.close()

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
        self.prefs.set_last_conversation(self.current_id)
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
        if not self.model_loaded or self.client.busy:
            return
        self.chat.remove_last_reply()
        self.chat.begin_reply()
        self.client.regenerate(self.generation_settings())

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
        self.menus.regenerate_action.setEnabled(self.model_loaded and not busy)
        self.send_button.setText("Stop" if busy else "Send")
        self.send_button.setEnabled(self.model_loaded)
        if not busy:
            self.speed_label.setText("")

    def generation_settings(self) -> GenerationSettings:
        return self.prefs.generation()

    def title(self) -> str:
        entry = self.library.get(self.current_id)
        return entry.title if entry else "New Chat"

    def update_title(self) -> None:
        self.setWindowTitle(f"{self.title()} — {APP_NAME}")
        self.setWindowFilePath(str(self.file) if self.file else "")


def _separator() -> QFrame:
    line = QFrame()
    line.setObjectName("separator")
    line.setFrameShape(QFrame.Shape.HLine)
    line.setFrameShadow(QFrame.Shadow.Plain)
    return line
