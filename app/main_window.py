"""The main window: the chat, its actions and menus, the docked panels, drag-and-drop of sessions and models.

It owns no engine state: requests go to the ConversationClient, results come back as signals, and the window only
mirrors what it needs to draw (current file, unsaved changes, busy).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QTimer, Qt, QUrl, Slot
from PySide6.QtGui import QAction, QCloseEvent, QDragEnterEvent, QDropEvent, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QDockWidget,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QTabWidget,
    QToolBar,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat_view import ChatView, PromptEdit
from app.coalescer import TextCoalescer
from app.dialogs import Dialogs
from app.hw_monitor import HardwareMonitor
from app.panels import CachePanel, MemoryPanel, PerformancePanel, SessionPanel, ThermalPanel
from app.preferences import Preferences
from app.quick_prompt import QuickPromptPanel
from app.standarddirs import StandardDirs
from app.worker import ConversationClient, LoadedModel, SessionFileEvent, TurnProgress, TurnResult
from engine.generate import GenerationSettings
from engine.paths import APP_NAME

SESSION_SUFFIX = ".spark"
NOTICE_INFO_MS = 6000
FINISH_NOTES = {"cancelled": "Stopped.", "length": "Reached the reply length limit; Settings can raise it.", "error": ""}


def _keys(standard: QKeySequence.StandardKey, fallback: str) -> list[QKeySequence]:
    """The platform's binding for a standard action, or `fallback` where it has none (e.g. Preferences on Linux).

    In `fallback`, Ctrl means ⌘ on macOS (Qt maps it), so one string serves both platforms.
    """
    return QKeySequence.keyBindings(standard) or [QKeySequence(fallback)]


class NoticeBar(QFrame):
    """A one-line message above the chat (errors stay until closed, information fades after a few seconds)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("noticeBar")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QToolButton()
        close.setText("✕")
        close.setAutoRaise(True)
        close.setToolTip("Dismiss")
        close.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(12, 6, 6, 6)
        layout.addWidget(self.label, 1)
        layout.addWidget(close)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.hide)
        self.hide()

    def show_message(self, text: str, error: bool) -> None:
        self.setProperty("kind", "error" if error else "info")
        self.style().unpolish(self)
        self.style().polish(self)
        self.label.setText(text)
        self.show()
        if error:
            self._timer.stop()
        else:
            self._timer.start(NOTICE_INFO_MS)

    def text(self) -> str:
        return "" if self.isHidden() else self.label.text()


class MainWindow(QMainWindow):
    def __init__(
        self,
        client: ConversationClient,
        quick_client: ConversationClient,
        monitor: HardwareMonitor,
        prefs: Preferences,
        dirs: StandardDirs,
        dialogs: Dialogs | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.monitor = monitor
        self.prefs = prefs
        self.dirs = dirs
        self.dialogs = dialogs or Dialogs(self)
        self.file: Path | None = None
        self.dirty = False
        self.model_loaded = False
        self._shut_down = False

        self.setObjectName("mainWindow")
        self.setAcceptDrops(True)
        self.setUnifiedTitleAndToolBarOnMac(True)
        self.setDockOptions(QMainWindow.DockOption.AnimatedDocks | QMainWindow.DockOption.AllowTabbedDocks)
        self.setTabPosition(Qt.DockWidgetArea.RightDockWidgetArea, QTabWidget.TabPosition.North)

        self._build_central()
        self._build_panels()
        self._build_actions()
        self._build_menus_and_toolbar()
        self._build_status_bar()
        self.quick_panel = QuickPromptPanel(quick_client, self._generation_settings)
        self._quick_client = quick_client
        self._connect()
        self._restore_layout()
        self._update_title()
        self._on_busy_changed(False)

    # -- construction ----------------------------------------------------------------------------------------------
    def _build_central(self) -> None:
        central = QWidget()
        central.setObjectName("central")
        self.notice = NoticeBar()
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
        self.chat.setAcceptDrops(False)  # drops belong to the window (sessions, model folders)
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

        layout = QVBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self.notice)
        layout.addWidget(system_row)
        layout.addWidget(_separator())
        layout.addWidget(self.chat, 1)
        layout.addWidget(_separator())
        layout.addWidget(composer)
        self.setCentralWidget(central)

    def _build_panels(self) -> None:
        self.cache_panel = CachePanel(self)
        self.thermal_panel = ThermalPanel(self)
        self.memory_panel = MemoryPanel(self)
        self.session_panel = SessionPanel(self)
        self.performance_panel = PerformancePanel(self)
        right = Qt.DockWidgetArea.RightDockWidgetArea
        self.addDockWidget(right, self.cache_panel)
        self.addDockWidget(right, self.performance_panel)
        self.addDockWidget(right, self.session_panel)
        self.tabifyDockWidget(self.performance_panel, self.thermal_panel)
        self.tabifyDockWidget(self.session_panel, self.memory_panel)
        self.performance_panel.raise_()
        self.session_panel.raise_()
        self.resizeDocks([self.cache_panel], [300], Qt.Orientation.Horizontal)

    @property
    def panels(self) -> list[QDockWidget]:
        return [self.cache_panel, self.performance_panel, self.thermal_panel, self.session_panel, self.memory_panel]

    def _action(self, text: str, slot: Callable[[], None], keys: list[QKeySequence] | None = None, tip: str = "") -> QAction:
        action = QAction(text, self)
        if keys:
            action.setShortcuts(keys)
        if tip:
            action.setToolTip(tip)
        action.triggered.connect(slot)
        self.addAction(action)  # shortcuts work even where the menu bar is hidden
        return action

    def _build_actions(self) -> None:
        SK = QKeySequence.StandardKey
        self.new_chat_action = self._action("New Chat", self._on_new_chat, _keys(SK.New, "Ctrl+N"), "Start a new conversation (⌘N)")
        self.open_action = self._action("Open Session…", self._on_open_session, _keys(SK.Open, "Ctrl+O"))
        self.save_action = self._action("Save Session", self._on_save, _keys(SK.Save, "Ctrl+S"))
        self.save_as_action = self._action("Save Session As…", self._on_save_as, _keys(SK.SaveAs, "Ctrl+Shift+S"))
        self.open_model_action = self._action("Open Model Folder…", self._on_open_model, [QKeySequence("Ctrl+Alt+O")], "Load another model")
        self.close_action = self._action("Close Window", self.close, _keys(SK.Close, "Ctrl+W"))
        self.quit_action = self._action("Quit MLoT Spark", self._on_quit, _keys(SK.Quit, "Ctrl+Q"))
        self.quit_action.setMenuRole(QAction.MenuRole.QuitRole)
        self.undo_action = self._action("Undo New Chat", self._on_undo_new_chat, _keys(SK.Undo, "Ctrl+Z"))
        self.undo_action.setEnabled(False)
        self.settings_action = self._action("Settings…", self._on_settings, _keys(SK.Preferences, "Ctrl+,"), "Sampling settings (⌘,)")
        self.settings_action.setMenuRole(QAction.MenuRole.PreferencesRole)
        self.stop_action = self._action("Stop", self._on_stop, [QKeySequence("Ctrl+.")], "Stop the reply (⌘.)")
        self.regenerate_action = self._action("Regenerate", self._on_regenerate, [QKeySequence("Ctrl+R")], "Answer the last prompt again (⌘R)")
        self.quick_action = self._action("Quick Prompt…", self.open_quick_prompt, [QKeySequence("Ctrl+Shift+K")])
        self.system_prompt_action = QAction("System Prompt", self)
        self.system_prompt_action.setCheckable(True)
        self.system_prompt_action.setChecked(True)
        self.system_prompt_action.toggled.connect(self.system_row.setVisible)

    def _build_menus_and_toolbar(self) -> None:
        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        for a in (self.new_chat_action, None, self.open_action, self.save_action, self.save_as_action, None, self.open_model_action, None, self.close_action, self.quit_action):
            file_menu.addAction(a) if a else file_menu.addSeparator()
        edit_menu = bar.addMenu("&Edit")
        edit_menu.addAction(self.undo_action)
        edit_menu.addSeparator()
        edit_menu.addAction(self.settings_action)
        chat_menu = bar.addMenu("&Chat")
        for a in (self.stop_action, self.regenerate_action):
            chat_menu.addAction(a)
        view_menu = bar.addMenu("&View")
        view_menu.addAction(self.system_prompt_action)
        view_menu.addSeparator()
        for dock in self.panels:
            view_menu.addAction(dock.toggleViewAction())
        window_menu = bar.addMenu("&Window")
        window_menu.addAction(self.quick_action)

        tools = QToolBar("Chat")
        tools.setObjectName("chatToolbar")
        tools.setMovable(False)
        tools.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        for a in (self.new_chat_action, self.regenerate_action, self.stop_action):
            tools.addAction(a)
        spacer = QWidget()
        spacer.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        tools.addWidget(spacer)
        self.model_button = QToolButton()
        self.model_button.setObjectName("modelButton")
        self.model_button.setDefaultAction(self.open_model_action)
        self.model_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        tools.addWidget(self.model_button)
        tools.addAction(self.settings_action)
        self.addToolBar(tools)

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
        w.progress.connect(self.performance_panel._on_progress)
        w.memory.connect(self.cache_panel._on_memory)
        w.memory.connect(self.memory_panel._on_memory)
        w.memory.connect(self.session_panel._on_memory)
        w.memory.connect(self.monitor._on_memory)
        w.finished.connect(self._on_finished)
        w.error.connect(self._on_error)
        w.conversation.connect(self._on_conversation)
        w.saved.connect(self._on_saved)
        w.restored.connect(self._on_restored)
        w.foreign_session.connect(self._on_foreign_session)
        w.system_prompt.connect(self._on_restored_system_prompt)
        w.policy.connect(self.thermal_panel._on_decision)
        self.client.busy_changed.connect(self._on_busy_changed)
        self.coalescer.flushed.connect(self.chat.append_reply)
        self.monitor.sampled.connect(self.thermal_panel._on_sample)
        self.monitor.sampled.connect(self.memory_panel._on_sample)
        self.prompt.submitted.connect(self.submit)
        self.send_button.clicked.connect(self._on_send_clicked)
        self.system_prompt.editingFinished.connect(self._on_system_prompt_edited)
        self.session_panel.save_requested.connect(self._on_save)
        self.session_panel.restore_requested.connect(self._on_open_session)

    def _restore_layout(self) -> None:
        geometry, state = self.prefs.window_geometry(), self.prefs.window_state()
        if geometry is None or not self.restoreGeometry(geometry):
            self.resize(1180, 760)
        if state is not None:
            self.restoreState(state)

    # -- public ------------------------------------------------------------------------------------------------------
    def load_model(self, model_dir: Path | None, backend: str = "auto") -> None:
        self.client.load(model_dir, backend)

    @Slot(str)
    def submit(self, text: str) -> bool:
        """Send `text` as the next user message; False (with a message) when it cannot be sent now."""
        if not self.model_loaded:
            self.notice.show_message("The model is still loading; your prompt is kept, send it when it is ready.", error=False)
            return False
        if self.client.busy:
            return False
        self.notice.hide()
        self.prompt.clear()
        self.chat.add_user_message(text)
        self.chat.begin_reply()
        self.undo_action.setEnabled(False)
        self.client.send(text, self._generation_settings())
        return True

    @Slot(Path)
    def open_file(self, path: Path) -> None:
        """A .spark file from Finder / the Dock / a drop / Open: restore it, asking first if changes would be lost."""
        if path.suffix != SESSION_SUFFIX:
            self.notice.show_message(f"MLoT Spark opens {SESSION_SUFFIX} session files; {path.name} is not one, so nothing changed.", error=True)
            return
        if not path.is_file():
            self.notice.show_message(f"The session {path.name} no longer exists; nothing changed.", error=True)
            return
        if self.dirty and not self.dialogs.confirm(
            "Open Session", f"The current conversation has unsaved changes. Replace it with {path.name}?", "Replace"
        ):
            return
        self.client.stop()
        self.client.restore(path)

    @Slot()
    def open_quick_prompt(self) -> None:
        self.quick_panel.open_centered()

    def shutdown(self) -> None:
        """Save the layout, stop any reply and autosave the conversation, end both worker threads. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        self.prefs.set_window(self.saveGeometry(), self.saveState())
        self.prefs.sync()
        self.quick_panel.close()
        self._quick_client.shutdown()
        self.client.shutdown()

    # -- drag and drop ---------------------------------------------------------------------------------------------
    def dragEnterEvent(self, event: QDragEnterEvent) -> None:  # noqa: N802 - Qt override
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:  # noqa: N802 - Qt override
        urls: list[QUrl] = event.mimeData().urls()
        event.acceptProposedAction()
        self.handle_drop([Path(u.toLocalFile()) for u in urls if u.isLocalFile()], len(urls))

    def handle_drop(self, paths: list[Path], count: int) -> None:
        if len(paths) != 1 or count != 1:
            self.notice.show_message("Drop one .spark session file or one model folder at a time; nothing changed.", error=True)
            return
        path = paths[0]
        if path.is_dir():
            if (path / "config.json").is_file():
                self.load_model(path)
            else:
                self.notice.show_message(f"{path.name} is not a model folder (it has no config.json); nothing changed.", error=True)
            return
        self.open_file(path)

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt override
        self.prefs.set_window(self.saveGeometry(), self.saveState())
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
        self.client.new_chat()
        self.session_panel.show_untitled(self.file)
        self.undo_action.setEnabled(self.dirty or bool(self.chat.toPlainText().strip()))
        self.file = None
        self.dirty = False
        self._update_title()

    @Slot()
    def _on_undo_new_chat(self) -> None:
        self.undo_action.setEnabled(False)
        self.client.undo_new_chat()
        self.dirty = True
        self._update_title()

    @Slot()
    def _on_regenerate(self) -> None:
        if not self.model_loaded or self.client.busy:
            return
        self.chat.remove_last_reply()
        self.chat.begin_reply()
        self.undo_action.setEnabled(False)
        self.client.regenerate(self._generation_settings())

    @Slot()
    def _on_save(self) -> None:
        if self.file is None:
            self._on_save_as()
        else:
            self.client.save(self.file)

    @Slot()
    def _on_save_as(self) -> None:
        path = self.dialogs.save_path(self.file or self.dirs.documents / f"Chat{SESSION_SUFFIX}")
        if path is not None:
            self.client.save(path)

    @Slot()
    def _on_open_session(self) -> None:
        path = self.dialogs.open_path(self.file.parent if self.file else self.dirs.documents)
        if path is not None:
            self.open_file(path)

    @Slot()
    def _on_open_model(self) -> None:
        start = self.prefs.last_model() or Path.home()
        path = self.dialogs.model_dir(start)
        if path is not None:
            self.handle_drop([path], 1)

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
        text = self.system_prompt.text().strip()
        self.prefs.set_system_prompt(text)
        self.client.set_system_prompt(text)

    # -- worker slots ------------------------------------------------------------------------------------------------
    @Slot(str)
    def _on_loading(self, model_dir: str) -> None:
        self.model_label.setText(f"Loading {Path(model_dir).name if model_dir else 'the built-in model'}…")
        self.load_progress.show()
        self.load_cancel.show()

    @Slot(LoadedModel)
    def _on_loaded(self, loaded: LoadedModel) -> None:
        info = loaded.info
        self.model_loaded = True
        self._end_loading()
        self.model_label.setText(f"{info.name} · {info.backend}")
        self.model_label.setToolTip(f"{info.path}\n{info.backend_detail}")
        self.model_button.setText(f"Model: {info.name}")
        self.prefs.set_last_model(info.path)
        self._quick_client.attach(loaded.engine)
        self.client.set_system_prompt(self.system_prompt.text().strip())
        self.performance_panel._on_model(info)
        self.memory_panel._on_model(info)
        self.monitor._on_model(info)
        self._on_busy_changed(self.client.busy)

    @Slot()
    def _on_load_cancelled(self) -> None:
        self._end_loading()
        self.model_label.setText("Model loading cancelled")

    def _end_loading(self) -> None:
        self.load_progress.hide()
        self.load_cancel.hide()

    @Slot(TurnProgress)
    def _on_progress(self, p: TurnProgress) -> None:
        if p.generated_tokens > 1:
            self.speed_label.setText(f"{p.tokens_per_s:.1f} tokens/s")

    @Slot(TurnResult)
    def _on_finished(self, result: TurnResult) -> None:
        self.coalescer.flush()  # text queued before `finished` is shown before the reply is closed
        self.chat.end_reply(FINISH_NOTES.get(result.reason, ""))
        if result.reason != "error":
            self.dirty = True
            self._update_title()

    @Slot(str)
    def _on_error(self, message: str) -> None:
        self.notice.show_message(message, error=True)
        if not self.model_loaded:
            self._end_loading()
            self.model_label.setText("No model loaded")

    @Slot(list)
    def _on_conversation(self, messages: list) -> None:
        self.coalescer.discard()
        self.chat.set_messages(messages)

    @Slot(SessionFileEvent)
    def _on_saved(self, event: SessionFileEvent) -> None:
        self.file = event.path
        self.dirty = False
        self.session_panel._on_file_event(event)
        self.notice.show_message(f"Saved {event.path.name}.", error=False)
        self._update_title()

    @Slot(SessionFileEvent)
    def _on_restored(self, event: SessionFileEvent) -> None:
        self.file = event.path
        self.dirty = False
        self.undo_action.setEnabled(False)
        self.session_panel._on_file_event(event)
        self.notice.show_message(f"Restored {event.path.name}" + (f" ({event.note})." if event.note else "."), error=False)
        self._update_title()

    @Slot(str, str)
    def _on_foreign_session(self, path: str, reason: str) -> None:
        if self.dialogs.confirm("Different Model", f"{reason}\n\nRestore the transcript only?", "Restore Transcript"):
            self.client.restore(Path(path), transcript_only=True)

    @Slot(str)
    def _on_restored_system_prompt(self, text: str) -> None:
        self.system_prompt.setText(text)

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

    def _update_title(self) -> None:
        name = self.file.name if self.file else "Untitled"
        self.setWindowTitle(f"{name}[*] — {APP_NAME}")
        self.setWindowFilePath(str(self.file) if self.file else "")
        self.setWindowModified(self.dirty)


def _separator() -> QFrame:
    line = QFrame()
    line.setObjectName("separator")
    line.setFrameShape(QFrame.Shape.HLine)
    line.setFrameShadow(QFrame.Shadow.Plain)
    return line

