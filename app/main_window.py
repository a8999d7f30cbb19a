"""The main window: history sidebar | chat | inspector, the menus and shortcuts, the model picker, drops and opens.

It owns no engine state: requests go to the ConversationClient, results come back as signals. Every conversation
lives in the library (the worker stores it after each change), so quitting, closing, New Chat or opening another
file never asks about unsaved work, and Undo (New Chat, Delete) reopens the stored conversation with its memory.
(Over 400 lines: it wires every window-level action; each slot is a few lines that delegate.)
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QEvent, QObject, Qt, QTimer, QUrl, Slot
from PySide6.QtGui import (
    QAction,
    QActionGroup,
    QCloseEvent,
    QDragEnterEvent,
    QDropEvent,
    QKeySequence,
    QResizeEvent,
)
from PySide6.QtWidgets import (
    QApplication,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QMenu,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QToolBar,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat_view import ChatView, PromptEdit
from app.coalescer import TextCoalescer
from app.dialogs import Dialogs
from app.history import HistorySidebar
from app.hw_monitor import HardwareMonitor
from app.inspector import Inspector
from app.library import (
    ConversationEntry,
    ConversationLibrary,
    export_json,
    export_markdown,
    new_id,
)
from app.preferences import Preferences
from app.quick_prompt import QuickPromptPanel
from app.remote_servers import RemoteServerList
from app.standarddirs import StandardDirs
from app.worker import (
    ConversationClient,
    LoadedModel,
    MessageView,
    ReadProgress,
    SessionFileEvent,
    StoredConversation,
    TurnProgress,
    TurnResult,
    remote_name,
)
from engine.backends import QUANTIZE_CHOICES
from engine.generate import FinishReason, GenerationSettings
from engine.errors import SparkError
from engine.model_files import DEFAULT_MODEL_NAME, default_model_path
from engine.remote import RemoteServer
from engine.paths import APP_NAME
from engine.session_file import atomic_write, load_session

SESSION_SUFFIX = ".spark"
NOTICE_INFO_MS = 6000
FINISH_NOTES = {FinishReason.CANCELLED: "Stopped.", FinishReason.LENGTH: "Reached the reply length limit; Settings can raise it.", "error": ""}
NARROW_WIDTH = 1100  # px: below it the inspector folds away so the chat keeps most of the window
PRECISION_WORDS = {
    "auto": "Automatic (as the file stores it; 8-bit blocks for a folder)",
    "none": "Full precision (fp32 on the CPU)",
    "q8_0": "8-bit blocks (Q8_0)",
    "q4_1": "4-bit blocks with offsets (Q4_1)",
    "q4_0": "4-bit blocks (Q4_0)",
    "int8": "8-bit (int8, Core ML only)",
}


def shortcut_text(action: QAction) -> str:
    """The action's shortcut as this platform writes it (⌘N on macOS, Ctrl+N elsewhere)."""
    return action.shortcut().toString(QKeySequence.SequenceFormat.NativeText)


def _keys(standard: QKeySequence.StandardKey, fallback: str) -> list[QKeySequence]:
    """The platform's binding for a standard action, or `fallback` (Ctrl = ⌘ on macOS) where it has none."""
    return QKeySequence.keyBindings(standard) or [QKeySequence(fallback)]


def is_model_path(path: Path) -> bool:
    return (path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.gguf")))) or (path.is_file() and path.suffix.lower() == ".gguf")


@dataclass(frozen=True)
class UndoStep:
    label: str  # "New Chat" | "Delete"
    reopen: str  # conversation id to open again
    entry: ConversationEntry | None = None  # a deleted conversation's row, to put back


class NoticeBar(QFrame):
    """A message laid over the top of the chat (it never pushes the layout); errors stay, information fades."""

    def __init__(self, parent: QWidget) -> None:
        super().__init__(parent)
        self.setObjectName("noticeBar")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.action_button = QPushButton()
        self.action_button.hide()
        close = QToolButton()
        close.setText("✕")
        close.setAutoRaise(True)
        close.setToolTip("Dismiss")
        close.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(12, 6, 6, 6)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.action_button)
        layout.addWidget(close)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.hide)
        self._action: Callable[[], None] | None = None
        self.action_button.clicked.connect(self._on_action)
        self._over = parent
        parent.installEventFilter(self)
        self.hide()

    def show_message(self, text: str, error: bool, action: tuple[str, Callable[[], None]] | None = None) -> None:
        self.setProperty("kind", "error" if error else "info")
        self.style().unpolish(self)
        self.style().polish(self)
        self.label.setText(text)
        self._action = action[1] if action else None
        self.action_button.setText(action[0] if action else "")
        self.action_button.setVisible(action is not None)
        self._place()
        self.show()
        self.raise_()
        if error:
            self._timer.stop()
        else:
            self._timer.start(NOTICE_INFO_MS)

    def text(self) -> str:
        return "" if self.isHidden() else self.label.text()

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.Resize:
            self._place()
        return False

    def _place(self) -> None:
        width = max(200, self._over.width() - 32)
        layout = self.layout()
        # A wrapped label's own size hint assumes some other width: ask the layout for this width's height.
        height = layout.totalHeightForWidth(width) if layout.hasHeightForWidth() else self.sizeHint().height()
        self.setFixedSize(width, height)
        self.move((self._over.width() - width) // 2, 10)

    def _on_action(self) -> None:
        self.hide()
        if self._action is not None:
            self._action()


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
        self._undo: list[UndoStep] = []
        self._opening: str | None = None  # the conversation id a restore in flight will become
        self._pending_files: list[Path] = []  # opened before the model was ready
        self._startup_id = prefs.last_conversation() if self.library.get(prefs.last_conversation()) else ""
        self._titles_for_new: dict[str, str] = {}  # branch/duplicate titles, applied when first stored
        self._shut_down = False
        self._narrow = False
        self._auto_layout = False

        self.setObjectName("mainWindow")
        self.setAcceptDrops(True)
        self.setUnifiedTitleAndToolBarOnMac(True)
        self._build_central()
        self._build_actions()
        self._build_menus_and_toolbar()
        self._build_status_bar()
        self.quick_panel = QuickPromptPanel(quick_client, self._generation_settings)
        self._quick_client = quick_client
        self._connect()
        self._restore_layout()
        self.sidebar.set_current(self.current_id)
        self._update_title()
        self._on_busy_changed(False)
        if self.library.load_error:
            self.notice.show_message(self.library.load_error, error=True)

    # -- construction ----------------------------------------------------------------------------------------------
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

    def _action(self, text: str, slot: Callable[[], None], keys: list[QKeySequence] | None = None, tip: str = "") -> QAction:
        action = QAction(text, self)
        if keys:
            action.setShortcuts(keys)
        if tip:
            shortcut = shortcut_text(action)
            action.setToolTip(f"{tip} ({shortcut})" if shortcut else tip)
        action.triggered.connect(slot)
        self.addAction(action)  # shortcuts work even where the menu bar is hidden
        return action

    def _build_actions(self) -> None:
        SK = QKeySequence.StandardKey
        self.new_chat_action = self._action("New Chat", self._on_new_chat, _keys(SK.New, "Ctrl+N"), "Start a new conversation")
        self.open_action = self._action("Open…", self._on_open_session, _keys(SK.Open, "Ctrl+O"))
        self.save_action = self._action("Save a Copy…", self._on_save, _keys(SK.Save, "Ctrl+S"))
        self.save_full_action = self._action("Save a Copy with Full Memory…", lambda: self._on_save(full_memory=True), _keys(SK.SaveAs, "Ctrl+Shift+S"))
        self.export_md_action = self._action("Export as Markdown…", lambda: self._on_export(self.current_id, "md"))
        self.export_json_action = self._action("Export as JSON…", lambda: self._on_export(self.current_id, "json"))
        self.open_model_action = self._action("Open Model…", self._on_open_model, [QKeySequence("Ctrl+Alt+O")], "Load a model folder or a .gguf file")
        self.open_model_folder_action = self._action("Open Model Folder…", self._on_open_model_folder)
        self.add_server_action = self._action("Add a Server…", self._on_add_server, tip="Chat with a model on an OpenAI-compatible server")
        self.close_action = self._action("Close Window", self.close, _keys(SK.Close, "Ctrl+W"))
        self.quit_action = self._action("Quit MLoT Spark", self._on_quit, _keys(SK.Quit, "Ctrl+Q"))
        self.quit_action.setMenuRole(QAction.MenuRole.QuitRole)
        self.undo_action = self._action("Undo", self._on_undo, _keys(SK.Undo, "Ctrl+Z"))
        self.undo_action.setEnabled(False)
        self.copy_action = self._action("Copy", lambda: self._edit("copy"), _keys(SK.Copy, "Ctrl+C"))
        self.select_all_action = self._action("Select All", lambda: self._edit("selectAll"), _keys(SK.SelectAll, "Ctrl+A"))
        self.find_action = self._action("Find Conversation…", self._on_find, _keys(SK.Find, "Ctrl+F"))
        self.rename_action = self._action("Rename Conversation…", lambda: self._on_rename(self.current_id))
        self.duplicate_action = self._action("Duplicate Conversation", lambda: self._on_duplicate(self.current_id))
        self.delete_action = self._action("Delete Conversation", lambda: self._on_delete(self.current_id), [QKeySequence("Ctrl+Backspace")])
        self.settings_action = self._action("Settings…", self._on_settings, _keys(SK.Preferences, "Ctrl+,"), "Sampling settings")
        self.settings_action.setMenuRole(QAction.MenuRole.PreferencesRole)
        self.stop_action = self._action("Stop", self._on_stop, [QKeySequence("Ctrl+.")], "Stop the reply")
        self.regenerate_action = self._action("Regenerate", self._on_regenerate, [QKeySequence("Ctrl+R")], "Answer the last prompt again")
        self.quick_action = self._action("Quick Prompt…", self.open_quick_prompt, [QKeySequence("Ctrl+Shift+K")])
        self.sidebar_action = self._toggle("Conversations", self.sidebar, self.prefs.sidebar_visible(), [QKeySequence("Ctrl+Shift+L")], self.prefs.set_sidebar_visible)
        self.inspector_action = self._toggle("Inspector", self.inspector, self.prefs.inspector_visible(), [QKeySequence("Ctrl+I")], self._remember_inspector)
        self.system_prompt_action = self._toggle("System Prompt", self.system_row, True, None, None)
        self.about_action = self._action(f"About {APP_NAME}", self._on_about)
        self.about_action.setMenuRole(QAction.MenuRole.AboutRole)
        self.help_action = self._action(f"{APP_NAME} Help", self._on_help, _keys(SK.HelpContents, "F1"))
        self.switch_actions = [self._action(f"Conversation {n}", lambda n=n: self._on_switch(n), [QKeySequence(f"Ctrl+{n}")]) for n in range(1, 10)]

    def _toggle(self, text: str, widget: QWidget, on: bool, keys: list[QKeySequence] | None, remember: Callable[[bool], None] | None) -> QAction:
        action = self._action(text, lambda: None, keys, text)
        action.setCheckable(True)
        action.setChecked(on)
        widget.setVisible(on)
        action.toggled.connect(widget.setVisible)
        if remember is not None:
            action.toggled.connect(remember)
        return action

    def _remember_inspector(self, shown: bool) -> None:
        if not self._auto_layout:  # the user's choice, not the narrow-window rule below
            self.prefs.set_inspector_visible(shown)

    def resizeEvent(self, event: QResizeEvent) -> None:
        """Below NARROW_WIDTH the chat keeps the room: the inspector folds away (⌘I still opens it) and comes back
        when the window is wide again, if the user had it open."""
        super().resizeEvent(event)
        narrow = self.width() < NARROW_WIDTH
        if narrow != self._narrow:
            self._narrow = narrow
            self._auto_layout = True
            self.inspector_action.setChecked(self.prefs.inspector_visible() and not narrow)
            self._auto_layout = False

    def _build_menus_and_toolbar(self) -> None:
        bar = self.menuBar()

        def menu(title: str, items: list[QAction | QMenu | None]) -> QMenu:
            m = bar.addMenu(title)
            for a in items:
                m.addSeparator() if a is None else m.addMenu(a) if isinstance(a, QMenu) else m.addAction(a)
            return m

        self.model_menu = QMenu("&Model", self)
        self.model_menu.aboutToShow.connect(self._fill_model_menu)
        self.precision_group = QActionGroup(self)
        self.precision_menu = QMenu("Weight Precision", self)
        for value in QUANTIZE_CHOICES:
            a = self.precision_menu.addAction(PRECISION_WORDS.get(value, value))
            a.setCheckable(True)
            a.setChecked(value == self.prefs.precision())
            a.setData(value)
            self.precision_group.addAction(a)
        self.precision_group.triggered.connect(self._on_precision)
        self._fill_model_menu()
        menu("&File", [self.new_chat_action, self.open_action, None, self.save_action, self.save_full_action, self.export_md_action, self.export_json_action, None, self.close_action, self.quit_action])
        menu("&Edit", [self.undo_action, None, self.copy_action, self.select_all_action, None, self.find_action, self.rename_action, self.duplicate_action, self.delete_action, None, self.settings_action])
        menu("&Chat", [self.stop_action, self.regenerate_action])
        bar.addMenu(self.model_menu)
        menu("&View", [self.sidebar_action, self.inspector_action, self.system_prompt_action])
        menu("&Window", [self.quick_action, None, *self.switch_actions])
        menu("&Help", [self.help_action, self.about_action])

        tools = QToolBar("Chat")
        tools.setObjectName("chatToolbar")
        tools.setMovable(False)
        tools.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        for a in (self.sidebar_action, self.new_chat_action, self.regenerate_action, self.stop_action):
            tools.addAction(a)
        spacer = QWidget()
        spacer.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        tools.addWidget(spacer)
        self.model_button = QToolButton()
        self.model_button.setObjectName("modelButton")
        self.model_button.setText("Model: loading…")
        self.model_button.setMenu(self.model_menu)
        self.model_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.model_button.setToolTip("Choose the model")
        tools.addWidget(self.model_button)
        tools.addAction(self.inspector_action)
        tools.addAction(self.settings_action)
        self.addToolBar(tools)

    def _fill_model_menu(self) -> None:
        m = self.model_menu
        m.clear()
        default = m.addAction(f"Default Model ({DEFAULT_MODEL_NAME})", lambda: self.load_model(None))
        default.setCheckable(True)
        default.setChecked(self.model_loaded and self.model_path is None and self.remote is None)
        recent = self.prefs.recent_models()
        if recent:
            m.addSection("Recent")
            for p in recent:
                a = m.addAction(p.name, lambda p=p: self.load_model(p))
                a.setToolTip(str(p))
                a.setCheckable(True)
                a.setChecked(p == self.model_path and self.remote is None)
        servers = self.remote_servers.all()
        if servers:
            m.addSection("Servers")
            for s in servers:
                a = m.addAction(remote_name(s), partial(self.use_remote, s))
                a.setToolTip(s.url)
                a.setCheckable(True)
                a.setChecked(s == self.remote)
        m.addSeparator()
        m.addAction(self.open_model_action)
        m.addAction(self.open_model_folder_action)
        m.addAction(self.add_server_action)
        m.addSeparator()
        m.addMenu(self.precision_menu)

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
        w.loading.connect(self._on_loading)
        w.loaded.connect(self._on_loaded)
        w.load_cancelled.connect(self._on_load_cancelled)
        w.delta.connect(self.coalescer.push)
        w.progress.connect(self._on_progress)
        w.progress.connect(self.inspector._on_progress)
        w.memory.connect(self.inspector._on_memory)
        w.memory.connect(self.monitor._on_memory)
        w.finished.connect(self._on_finished)
        w.error.connect(self._on_error)
        w.conversation.connect(self._on_conversation)
        w.saved.connect(self._on_saved)
        w.restored.connect(self._on_restored)
        w.foreign_session.connect(self._on_foreign_session)
        w.system_prompt.connect(self._on_restored_system_prompt)
        w.policy.connect(self.inspector.thermal_panel._on_decision)
        w.reading.connect(self._on_reading)
        w.stored.connect(self._on_stored)
        w.remote_ready.connect(self._on_remote_ready)
        self.client.busy_changed.connect(self._on_busy_changed)
        self.coalescer.flushed.connect(self.chat.append_reply)
        self.monitor.sampled.connect(self.inspector._on_sample)
        self.prompt.submitted.connect(self.submit)
        self.send_button.clicked.connect(self._on_send_clicked)
        self.system_prompt.editingFinished.connect(self._on_system_prompt_edited)
        self.system_prompt.textChanged.connect(self._on_system_prompt_text)
        self.inspector.session_panel.save_requested.connect(self._on_save)
        self.inspector.session_panel.restore_requested.connect(self._on_open_session)
        self.chat.branch_requested.connect(self._on_branch)
        self.chat.copied.connect(lambda _: self.notice.show_message("Copied.", error=False))
        self.sidebar.open_requested.connect(self.open_conversation)
        self.sidebar.rename_requested.connect(self._on_rename)
        self.sidebar.duplicate_requested.connect(self._on_duplicate)
        self.sidebar.delete_requested.connect(self._on_delete)
        self.sidebar.export_requested.connect(self._on_export)

    def _restore_layout(self) -> None:
        geometry = self.prefs.window_geometry()
        if geometry is None or not self.restoreGeometry(geometry):
            self.resize(1180, 760)
        side = 230 if self.width() >= NARROW_WIDTH else 190
        self.splitter.setSizes([side, max(400, self.width() - side - 280), 280])

    # -- public ------------------------------------------------------------------------------------------------------
    def load_model(self, model: Path | None, backend: str = "auto") -> None:
        if self.model_loaded and self.library.get(self.current_id):
            self._opening = self.current_id  # the worker carries it over to the new model: no sending until then
        self.client.load(model, backend, self.prefs.precision())

    def use_remote(self, server: RemoteServer) -> None:
        """Chat with `server` from now on; the open conversation goes on there as its transcript. (Requests are
        queued in order: a local model still loading finishes first, so the quick prompt keeps it, then this wins.)"""
        self.client.stop()
        self.client.use_remote(server)

    def open_conversation(self, conversation_id: str) -> None:
        """Switch to a stored conversation: its transcript and memory come back (recomputed where compact)."""
        if not self.library.get(conversation_id) or conversation_id in (self.current_id, self._opening) or not self.model_loaded:
            return
        self.client.stop()
        self._opening = conversation_id
        self.sidebar.set_current(conversation_id)  # selected at once; its words follow, then its memory
        path = self.library.path_for(conversation_id)
        self.client.restore(path, store_path=path)

    @Slot(str)
    def submit(self, text: str) -> bool:
        """Send `text` as the next user message; False (with a message saying why) when it cannot be sent now."""
        if not self.model_loaded:
            self.notice.show_message("The model is still loading; your message is kept, send it when it is ready.", error=False)
            return False
        if self._opening is not None:
            self.notice.show_message("Spark is still opening this conversation (recomputing its memory); your message is kept, send it in a moment.", error=False)
            return False
        if self.client.busy:
            self.notice.show_message(
                f"Spark is still writing; your message is kept. Stop the reply ({shortcut_text(self.stop_action)}) to send it now.",
                error=False,
                action=("Stop", self._on_stop),
            )
            return False
        self.notice.hide()
        self.prompt.clear()
        self.chat.add_user_message(text)
        self.chat.begin_reply()
        self.chat.show_reading("Reading…")
        self.client.send(text, self._generation_settings())
        return True

    @Slot(Path)
    def open_file(self, path: Path) -> None:
        """A .spark file or a model from the command line, Finder/Dock, a drop or Open. The current conversation is
        already stored, so nothing is asked: an opened file becomes a new conversation in the history."""
        if is_model_path(path):
            self.load_model(path)
            return
        if path.suffix != SESSION_SUFFIX:
            self.notice.show_message(f"MLoT Spark opens {SESSION_SUFFIX} conversations, model folders and .gguf models; {path.name} is none of these, so nothing changed.", error=True)
            return
        if not path.is_file():
            self.notice.show_message(f"The file {path.name} no longer exists; nothing changed.", error=True)
            return
        if not self.model_loaded or self._opening is not None:
            self._pending_files.append(path)  # opened once the model is ready (or the conversation opening now is)
            return
        self.client.stop()
        self._opening = new_id()
        self.client.restore(path, store_path=self.library.path_for(self._opening))

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
        self._quick_client.shutdown()
        self.client.shutdown()
        QCoreApplication.sendPostedEvents(self, QEvent.Type.MetaCall)  # the worker's last "stored" reaches the index
        self.library.close()

    # -- drag and drop ---------------------------------------------------------------------------------------------
    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        urls: list[QUrl] = event.mimeData().urls()
        event.acceptProposedAction()
        self.handle_drop([Path(u.toLocalFile()) for u in urls if u.isLocalFile()], len(urls))

    def handle_drop(self, paths: list[Path], count: int) -> None:
        if len(paths) != 1 or count != 1:
            self.notice.show_message("Drop one .spark conversation, one model folder or one .gguf file at a time; nothing changed.", error=True)
            return
        path = paths[0]
        if path.is_dir() and not is_model_path(path):
            self.notice.show_message(f"{path.name} is not a model folder (it has no config.json or .gguf); nothing changed.", error=True)
            return
        self.open_file(path)

    def closeEvent(self, event: QCloseEvent) -> None:
        # Nothing to ask: the conversation is stored as it changes (and once more on quit).
        self.prefs.set_window(self.saveGeometry(), self.saveState())
        self.prefs.set_last_conversation(self.current_id)
        super().closeEvent(event)

    # -- action slots ------------------------------------------------------------------------------------------------
    @Slot()
    def _on_send_clicked(self) -> None:
        if self.client.busy:
            self._on_stop()
            return
        text = self.prompt.toPlainText().strip()
        if text:
            self.submit(text)

    @Slot()
    def _on_stop(self) -> None:
        self.client.stop()

    @Slot()
    def _on_new_chat(self) -> None:
        self.client.stop()
        if self.library.get(self.current_id):
            self._push_undo(UndoStep("New Chat", self.current_id))
        self._start_new()

    def _start_new(self) -> None:
        self.current_id = new_id()
        self.file = None
        self.client.new_chat(self.library.path_for(self.current_id))
        self.coalescer.discard()
        self.chat.set_messages([])
        self.sidebar.set_current(self.current_id)
        self.inspector.session_panel.show_untitled(None)
        self._update_title()

    @Slot()
    def _on_undo(self) -> None:
        if not self._undo:
            return
        step = self._undo.pop()
        if step.entry is not None and not self.library.undelete(step.entry):
            self.notice.show_message("The deleted conversation is no longer in the trash, so it cannot come back.", error=True)
        elif self.library.get(step.reopen):
            self.sidebar.refresh()
            self.open_conversation(step.reopen)
        self._update_undo()

    def _push_undo(self, step: UndoStep) -> None:
        self._undo.append(step)
        self._update_undo()

    def _update_undo(self) -> None:
        self.undo_action.setEnabled(bool(self._undo))
        self.undo_action.setText(f"Undo {self._undo[-1].label}" if self._undo else "Undo")

    @Slot()
    def _on_regenerate(self) -> None:
        if not self.model_loaded or self.client.busy:
            return
        self.chat.remove_last_reply()
        self.chat.begin_reply()
        self.client.regenerate(self._generation_settings())

    def _on_save(self, full_memory: bool = False) -> None:
        start = self.file or self.dirs.documents / f"{_file_name(self._title())}{SESSION_SUFFIX}"
        path = self.dialogs.save_path(start)
        if path is not None:
            self.client.save(path, full_memory)

    @Slot()
    def _on_open_session(self) -> None:
        path = self.dialogs.open_path(self.file.parent if self.file else self.dirs.documents)
        if path is not None:
            self.open_file(path)

    @Slot()
    def _on_open_model(self) -> None:
        path = self.dialogs.model_file(self._model_start())
        if path is not None:
            self.handle_drop([path], 1)

    @Slot()
    def _on_open_model_folder(self) -> None:
        path = self.dialogs.model_dir(self._model_start())
        if path is not None:
            self.handle_drop([path], 1)

    def _model_start(self) -> Path:
        recent = self.prefs.recent_models()
        return recent[0].parent if recent else Path.home()

    @Slot()
    def _on_add_server(self) -> None:
        server = self.dialogs.add_server()
        if server is not None:
            self.remote_servers.add(server)
            self.use_remote(server)

    def _on_precision(self, action: QAction) -> None:
        self.prefs.set_precision(str(action.data()))
        if self.model_loaded and self.remote is None:  # a remote model's precision is the server's business
            self.load_model(self.model_path)

    @Slot()
    def _on_settings(self) -> None:
        edited = self.dialogs.edit_settings(self._generation_settings())
        if edited is not None:
            self.prefs.set_generation(edited)

    @Slot()
    def _on_quit(self) -> None:
        self.shutdown()
        QApplication.quit()

    @Slot()
    def _on_system_prompt_edited(self) -> None:
        self.client.set_system_prompt(self.system_prompt.text().strip())

    @Slot(str)
    def _on_system_prompt_text(self, text: str) -> None:
        self.prefs.set_system_prompt(text.strip())  # a cleared prompt stays cleared after a restart
        if not text:  # the clear button emits no editingFinished
            self.client.set_system_prompt("")

    def _edit(self, what: str) -> None:
        target = QApplication.focusWidget()
        if not hasattr(target, what):
            target = self.chat
        getattr(target, what)()

    @Slot()
    def _on_find(self) -> None:
        self.sidebar_action.setChecked(True)
        self.sidebar.search.setFocus()
        self.sidebar.search.selectAll()

    def _on_switch(self, n: int) -> None:
        ids = self.sidebar.ids()
        if n <= len(ids) and ids[n - 1]:
            self.open_conversation(ids[n - 1])

    @Slot(str)
    def _on_rename(self, conversation_id: str) -> None:
        entry = self.library.get(conversation_id)
        if entry is None:
            self.notice.show_message("This conversation has no messages yet, so there is nothing to rename.", error=False)
            return
        title = self.dialogs.ask_text("Rename Conversation", "Title:", entry.title)
        if title:
            self.library.rename(conversation_id, title)
            self.sidebar.refresh()
            self._update_title()

    @Slot(str)
    def _on_duplicate(self, conversation_id: str) -> None:
        entry = self.library.get(conversation_id)
        if entry is None:
            return
        copy_id = new_id()
        try:
            shutil.copyfile(self.library.path_for(conversation_id), self.library.path_for(copy_id))
            messages = [(m.role, m.content) for m in load_session(self.library.path_for(copy_id)).messages]
        except Exception as exc:  # noqa: BLE001 - one sentence; the original is untouched
            self.library.path_for(copy_id).unlink(missing_ok=True)
            self.notice.show_message(f"The conversation could not be duplicated ({exc}).", error=True)
            return
        self.library.record(copy_id, messages, entry.model)
        self.library.rename(copy_id, f"{entry.title} (copy)")
        self.sidebar.refresh()
        self.open_conversation(copy_id)

    @Slot(int)
    def _on_branch(self, index: int) -> None:
        """A new conversation holding this one up to message `index`, with the memory of that point."""
        entry = self.library.get(self.current_id)
        if entry is None or self.client.busy or not self.model_loaded:
            if self.client.busy:
                self.notice.show_message("Wait for the reply to finish, then branch.", error=False)
            return
        source = self.library.path_for(self.current_id)
        self._push_undo(UndoStep("Branch", self.current_id))
        self.current_id = new_id()
        self._titles_for_new[self.current_id] = f"{entry.title} (branch)"
        self.client.branch(source, self.library.path_for(self.current_id), index)
        self.chat.set_messages([])
        self.sidebar.set_current(self.current_id)
        self._update_title()

    @Slot(str)
    def _on_delete(self, conversation_id: str) -> None:
        if self.client.busy and conversation_id == self.current_id:
            self.client.stop()
        entry = self.library.get(conversation_id)
        if entry is None:
            if conversation_id == self.current_id:
                self._start_new()  # an empty chat: deleting it is just clearing it
            return
        if conversation_id == self.current_id:
            self._start_new()
        self.library.delete(conversation_id)
        self._push_undo(UndoStep("Delete", conversation_id, entry))
        self.sidebar.refresh()
        self.notice.show_message(f"Deleted “{entry.title}”.", error=False, action=("Undo", self._on_undo))

    @Slot(str, str)
    def _on_export(self, conversation_id: str, kind: str) -> None:
        entry = self.library.get(conversation_id)
        if entry is None:
            self.notice.show_message("This conversation has no messages yet, so there is nothing to export.", error=False)
            return
        path = self.dialogs.export_path(self.dirs.documents / f"{_file_name(entry.title)}.{kind}", kind)
        if path is None:
            return
        try:
            messages = [(m.role, m.content) for m in load_session(self.library.path_for(conversation_id)).messages]
            text = export_markdown(entry.title, messages) if kind == "md" else export_json(entry.title, messages, entry.model)
            atomic_write(path, [text.encode("utf-8")])
        except Exception as exc:  # noqa: BLE001 - one sentence, nothing lost
            self.notice.show_message(f"The conversation could not be exported to {path.name} ({exc}).", error=True)
            return
        self.notice.show_message(f"Exported {path.name}.", error=False)

    @Slot()
    def _on_about(self) -> None:
        self.dialogs.about()

    @Slot()
    def _on_help(self) -> None:
        self.dialogs.help(self._help_keys())

    def _help_keys(self) -> list[tuple[str, str]]:
        acts = [self.new_chat_action, self.find_action, self.delete_action, self.inspector_action, self.stop_action, self.regenerate_action, self.undo_action, self.switch_actions[0]]
        return [(a.text().replace("Conversation 1", "Conversation 1…9"), shortcut_text(a)) for a in acts]

    # -- worker slots ------------------------------------------------------------------------------------------------
    @Slot(str)
    def _on_loading(self, model_dir: str) -> None:
        self.model_label.setText(f"Loading {Path(model_dir).name if model_dir else 'the default model'}…")
        self.load_progress.show()
        self.load_cancel.show()

    @Slot(LoadedModel)
    def _on_loaded(self, loaded: LoadedModel) -> None:
        info = loaded.info
        first = not self.model_loaded
        self.model_loaded = True
        self.remote = None
        self._end_loading()
        resume = self._last_remote() if first else None
        self.model_path = None if _is_default(info.path) else info.path
        runs = info.backend_detail.partition(" (skipped ")[0]
        self.model_label.setText(f"{info.name} · {runs}")
        self.model_label.setToolTip(f"{info.path}\n{info.backend_detail}")
        self.model_button.setText(f"Model: {info.name}")
        self.prefs.set_last_model(self.model_path)
        self._quick_client.attach(loaded.engine)
        self.client.set_system_prompt(self.system_prompt.text().strip())
        self.inspector._on_model(info)
        self.monitor._on_model(info)
        self._on_busy_changed(self.client.busy)
        if resume is not None:  # the app was left chatting with a server: back to it (queued before the reopening)
            self.use_remote(resume)
        else:
            self.prefs.set_last_remote(None)
        if first:
            self._first_ready()

    def _last_remote(self) -> RemoteServer | None:
        last = self.prefs.last_remote()
        return next((s for s in self.remote_servers.all() if (s.url, s.model) == last), None)

    def _first_ready(self) -> None:
        """The first model (local or remote) is ready: the chat gets its file, and the app reopens where it was."""
        self.client.new_chat(self.library.path_for(self.current_id))
        if self._startup_id and not self._pending_files:  # reopen where the user left off, unless a file was asked for
            self.open_conversation(self._startup_id)
        if self._pending_files:  # one at a time: each next one opens when the previous is restored
            self.open_file(self._pending_files.pop(0))

    @Slot(object)
    def _on_remote_ready(self, server: RemoteServer) -> None:
        first = not self.model_loaded
        self.model_loaded = True
        self.remote = server
        self.prefs.set_last_remote(server.url, server.model)
        self.model_label.setText(f"{remote_name(server)} · remote server")
        self.model_label.setToolTip(server.url)
        self.model_button.setText(f"Model: {server.model}")
        self.inspector.show_remote(server)
        self._on_busy_changed(self.client.busy)
        if first:
            self._first_ready()

    @Slot()
    def _on_load_cancelled(self) -> None:
        self._opening = None
        self._end_loading()
        self.model_label.setText("Model loading cancelled")

    def _end_loading(self) -> None:
        self.load_progress.hide()
        self.load_cancel.hide()

    @Slot(ReadProgress)
    def _on_reading(self, p: ReadProgress) -> None:
        rate = f" · {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else ""
        left = f" · about {p.seconds_left:,.0f} s left" if p.seconds_left >= 1 else ""
        if p.kind == "prompt":
            self.chat.show_reading(f"Reading {p.done:,} of {p.total:,} tokens{rate}{left}")
        elif p.done < p.total:
            self.notice.show_message(f"Recomputing this conversation's memory: {p.done:,} of {p.total:,} tokens{rate}{left}", error=False)

    @Slot(TurnProgress)
    def _on_progress(self, p: TurnProgress) -> None:
        if p.generated_tokens > 1:
            self.speed_label.setText(f"{p.tokens_per_s:.1f} tokens/s")

    @Slot(TurnResult)
    def _on_finished(self, result: TurnResult) -> None:
        self.coalescer.flush()  # text queued before `finished` is shown before the reply is closed
        notes = [FINISH_NOTES.get(result.reason, "")]
        if result.reason == FinishReason.CANCELLED and not result.progress.generated_tokens:
            notes = ["Stopped while reading; nothing was written."]
        if result.recalled_turns_ago:
            n = result.recalled_turns_ago
            notes.append(f"↺ Recalled from {n} turn{'s' if n != 1 else ''} ago.")
        note = " ".join(n for n in notes if n)
        self.chat.end_reply(note)
        if note:  # kept with the conversation, so reopening it (Undo, relaunch) shows it again
            self.library.set_note(self.current_id, self.chat.last_index(), note)

    @Slot(str)
    def _on_error(self, message: str) -> None:
        self.notice.show_message(message, error=True)
        if self._opening is not None:
            self._opening = None
            self.sidebar.set_current(self.current_id)  # the conversation that stays open
        if self._pending_files and self.model_loaded:
            QTimer.singleShot(0, lambda: self.open_file(self._pending_files.pop(0)))
        if not self.model_loaded:
            self._end_loading()
            self.model_label.setText("No model loaded")

    @Slot(list)
    def _on_conversation(self, messages: list[MessageView]) -> None:
        self.coalescer.discard()
        entry = self.library.get(self._opening or self.current_id)
        self.chat.set_messages(messages, dict(entry.notes) if entry else None)

    @Slot(StoredConversation)
    def _on_stored(self, stored: StoredConversation) -> None:
        cid = stored.path.stem
        if cid != self.current_id and self.library.get(cid) is None:
            return  # deleted (or left) before this store arrived
        self.library.record(cid, list(stored.messages), stored.model)
        title = self._titles_for_new.pop(cid, None)
        if title:
            self.library.rename(cid, title)
        self.sidebar.refresh()
        self.inspector.show_stored(f"Stored automatically ({len(stored.messages)} messages).")
        self._update_title()

    @Slot(SessionFileEvent)
    def _on_saved(self, event: SessionFileEvent) -> None:
        self.file = event.path
        self.inspector.session_panel._on_file_event(event)
        self.notice.show_message(f"Saved a copy as {event.path.name}.", error=False)

    @Slot(SessionFileEvent)
    def _on_restored(self, event: SessionFileEvent) -> None:
        if self._opening:
            self.current_id = self._opening
            self._opening = None
        if self._pending_files:
            QTimer.singleShot(0, lambda: self.open_file(self._pending_files.pop(0)))
        in_library = event.path.parent == self.library.folder
        self.file = None if in_library else event.path
        self.inspector.session_panel._on_file_event(event)
        if not in_library or event.note:
            self.notice.show_message(f"Opened {event.path.name}" + (f" ({event.note})." if event.note else "."), error=bool(event.note) and "differs" in event.note)
        elif self.notice.text().startswith("Recomputing"):
            self.notice.hide()
        self.sidebar.set_current(self.current_id)
        self._update_title()

    @Slot(str, str)
    def _on_foreign_session(self, path: str, reason: str) -> None:
        if self.dialogs.confirm("Different Model", f"{reason}\n\nRestore the transcript only?", "Restore Transcript"):
            self.client.restore(Path(path), transcript_only=True, store_path=self.library.path_for(self._opening or new_id()))
        else:
            self._opening = None

    @Slot(str)
    def _on_restored_system_prompt(self, text: str) -> None:
        self.system_prompt.blockSignals(True)
        self.system_prompt.setText(text)
        self.system_prompt.blockSignals(False)

    @Slot(bool)
    def _on_busy_changed(self, busy: bool) -> None:
        self.stop_action.setEnabled(busy)
        self.regenerate_action.setEnabled(self.model_loaded and not busy)
        self.send_button.setText("Stop" if busy else "Send")
        self.send_button.setEnabled(self.model_loaded)
        if not busy:
            self.speed_label.setText("")

    # -- helpers -----------------------------------------------------------------------------------------------------
    def _generation_settings(self) -> GenerationSettings:
        return self.prefs.generation()

    def _title(self) -> str:
        entry = self.library.get(self.current_id)
        return entry.title if entry else "New Chat"

    def _update_title(self) -> None:
        self.setWindowTitle(f"{self._title()} — {APP_NAME}")
        self.setWindowFilePath(str(self.file) if self.file else "")


def _is_default(path: Path) -> bool:
    try:
        return path.resolve() == default_model_path().resolve()
    except (OSError, SparkError):  # not installed or damaged: nothing is the default
        return False


def _file_name(title: str) -> str:
    """A title as a file name: no path separators or characters Finder or Windows refuse."""
    name = "".join(c if c not in '/\\:*?"<>|' and c.isprintable() else " " for c in title).strip(" .…")
    return name[:80] or "Conversation"


def _separator() -> QFrame:
    line = QFrame()
    line.setObjectName("separator")
    line.setFrameShape(QFrame.Shape.HLine)
    line.setFrameShadow(QFrame.Shadow.Plain)
    return line
