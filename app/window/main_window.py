"""The main window: history sidebar | chat | inspector and the status bar, composed.

It builds the widgets, the helpers and the two presenters, and connects them in one place (`_connect_signals`):
`ConversationPresenter` (what is sent and comes back, the open conversation and its settings) and `ModelPresenter`
(loading, the model or server that replies, the inspector's reports) hear the conversation client's signals and
drive the widgets through their public methods; the menus and the conversation commands (`app.window.commands`)
share the small `WindowState` and speak through signals. What stays here is the window's own: its layout as it
narrows and widens, drops, the status bar's server link, Find and Rename, and quitting.

It owns no engine state: requests go to the ConversationClient, results come back as its signals. Every conversation
lives in the library (the worker stores it after each change), so quitting, closing, New Chat or opening another
file never asks about unsaved work, and Undo (New Chat, Delete) reopens the stored conversation with its memory.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QCoreApplication, QEvent, Qt, QUrl, Slot
from PySide6.QtGui import QCloseEvent, QDragEnterEvent, QDropEvent, QGuiApplication, QResizeEvent
from PySide6.QtWidgets import (
    QApplication,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.application import SparkApplication
from app.history.library import ConversationLibrary
from app.history.sidebar import HistorySidebar
from app.inspector.hw_monitor import HardwareMonitor
from app.inspector.inspector import Inspector
from app.misc.standarddirs import StandardDirs
from app.models import downloaded_models, open_get_models
from app.server.local_server import LocalServerController, local_server_actions
from app.settings.preferences import Preferences
from app.settings.remote_servers import RemoteServerList
from app.tray.quick_prompt import QuickPromptPanel
from app.window.chat_view import ChatView
from app.window.commands import ConversationCommands
from app.window.composer import Composer
from app.window.conversation_presenter import ConversationPresenter
from app.window.dialogs import Dialogs
from app.window.memory_controls import MemoryControls
from app.window.menus import WindowMenus
from app.window.model_presenter import ModelPresenter
from app.window.notice_bar import NoticeBar
from app.window.settings_presenter import SettingsPresenter
from app.window.state import WindowState
from app.window.status_items import StatusItems
from app.window.think_switch import ThinkSwitch
from app.window.views import WindowViews
from app.worker.client import ConversationClient
from engine.paths import APP_NAME

NARROW_WIDTH = 1100  # px: below it the inspector folds away so the chat keeps most of the window
SIDEBAR_WIDE, SIDEBAR_NARROW = 230, 190  # px: the sidebar's width above and below NARROW_WIDTH
INSPECTOR_WIDTH = 280  # px: the inspector's width when it opens


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
        self.quick_client = quick_client
        self.monitor = monitor
        self.local_server = local_server
        self.prefs = prefs
        self.dirs = dirs
        self.dialogs = dialogs or Dialogs(self)
        self.library = library or ConversationLibrary(dirs.conversations)
        self.library.load()
        self.state = WindowState()
        self.remote_servers = RemoteServerList(prefs.settings)
        self._shut_down = False
        self.workers_done = False  # set by shutdown: both worker threads ended
        self._narrow = False
        self.auto_layout = False
        self.get_models_dialog: QWidget | None = None

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
        self.status = StatusItems(self.statusBar(), self)
        views = WindowViews(
            chat=self.chat,
            composer=self.composer,
            think_switch=self.think_switch,
            system_prompt=self.system_prompt,
            notice=self.notice,
            sidebar=self.sidebar,
            inspector=self.inspector,
            menus=self.menus,
            status=self.status,
        )
        # The model's presenter hears the client first: its reports reach the inspector before the chat's reading.
        self.model = ModelPresenter(
            client,
            quick_client,
            monitor,
            local_server,
            self.state,
            views,
            prefs,
            self.library,
            self.remote_servers,
            self,
        )
        self.settings = settings = SettingsPresenter(client, self.state, self.library, prefs, self.dialogs, views, self)
        self.conversation = conv = ConversationPresenter(
            client, self.state, self.library, prefs, self.dialogs, views, settings.reply_settings, self
        )
        self.coalescer = conv.coalescer
        # The window's verbs, as the command line, a second launch, the screenshots and the tests call them.
        self.submit = conv.submit
        self.regenerate = conv.regenerate
        self.stop_reply = conv.stop_reply
        self.open_conversation = conv.open_conversation
        self.open_file = conv.open_file
        self.handle_drop = conv.handle_drop
        self.reply_settings = settings.reply_settings
        self.generation_settings = settings.generation_settings
        self.show_reply_json = settings.show_reply_json
        self.title = conv.title
        self.load_model = self.model.load_model
        self.use_remote = self.model.use_remote
        self.quick_panel = QuickPromptPanel(quick_client, settings.generation_settings)
        self._connect_signals()
        self._connect_memory()
        self._restore_layout()
        conv.show_current()
        settings.show_reply_json()

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

    def _connect_signals(self) -> None:
        """Every connection between the widgets, the helpers and the presenters (each presenter connects the client's
        signals it hears itself)."""
        conv, settings, model, cmd, m = self.conversation, self.settings, self.model, self.commands, self.menus
        model.model_shown.connect(settings.show_sampling)
        model.model_shown.connect(conv.on_model_shown)
        conv.current_shown.connect(settings.show_current)
        model.first_ready.connect(conv.on_first_ready)
        conv.model_requested.connect(model.load_model)
        conv.title_changed.connect(self._show_title)
        self.status.cancel_requested.connect(model.cancel_load)
        self.status.copy_requested.connect(self._copy_server_url)
        self.monitor.sampled.connect(self.inspector.on_sample)
        self.prompt.submitted.connect(conv.submit)
        self.send_button.clicked.connect(conv.send_or_stop)
        self.system_prompt.editingFinished.connect(settings.system_prompt_edited)
        self.system_prompt.textChanged.connect(settings.system_prompt_typed)
        self.inspector.session_panel.save_requested.connect(cmd.save)
        self.inspector.session_panel.restore_requested.connect(cmd.open_session)
        self.chat.branch_requested.connect(cmd.branch)
        self.chat.regenerate_requested.connect(conv.regenerate)
        self.chat.example_chosen.connect(conv.submit)
        self.sidebar.open_requested.connect(conv.open_conversation)
        self.sidebar.renamed.connect(cmd.rename)
        self.sidebar.duplicate_requested.connect(cmd.duplicate)
        self.sidebar.delete_requested.connect(cmd.delete)
        self.sidebar.export_requested.connect(cmd.export)
        cmd.current_changed.connect(conv.on_current_changed)
        cmd.chat_cleared.connect(conv.clear_chat)
        cmd.history_changed.connect(self.sidebar.refresh)
        cmd.history_changed.connect(conv.update_title)
        cmd.open_requested.connect(conv.open_conversation)
        cmd.file_requested.connect(conv.open_file)
        cmd.notice.connect(conv.show_notice)
        cmd.undo_changed.connect(conv.show_undo)
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
            (m.stop_action, conv.stop_reply),
            (m.regenerate_action, conv.regenerate),
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
        m.model_chosen.connect(model.load_model)
        m.get_models_action.triggered.connect(self._on_get_models)
        m.model_path_chosen.connect(lambda path: conv.handle_drop([path], 1))
        m.server_chosen.connect(model.use_remote)
        m.precision_changed.connect(model.on_precision)
        m.tool_servers_changed.connect(settings.apply_tool_servers)
        m.sampling_changed.connect(settings.show_sampling)
        m.conversation_sampling_action.triggered.connect(settings.edit_conversation_sampling)
        m.reply_json_toggled.connect(settings.set_reply_json)
        m.appearance_chosen.connect(self._on_appearance)
        m.json_schema_requested.connect(settings.edit_reply_schema)
        self.composer.json_chip.clicked.connect(lambda: settings.set_reply_json(False))
        self.inspector.sampling_requested.connect(settings.edit_conversation_sampling)
        settings.apply_tool_servers()
        m.conversation_chosen.connect(conv.open_conversation)
        switch, copy = local_server_actions(self.local_server, self)
        self.server_switch, self.server_copy = switch, copy
        m.add_server_actions(switch, copy)
        self.local_server.state_changed.connect(self.status.show_server)
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
            self.dirs.documents,
            self.menus.chat_menu,
        )

    def _remember_inspector(self, shown: bool) -> None:
        if not self.auto_layout:  # the user's choice, not the narrow-window rule
            self.prefs.set_inspector_visible(shown)

    @Slot(str, str)
    def _show_title(self, title: str, file: str) -> None:
        self.setWindowTitle(f"{title} — {APP_NAME}")
        self.setWindowFilePath(file)

    @Slot()
    def open_quick_prompt(self) -> None:
        self.quick_panel.open_centered()

    @Slot()
    def _on_get_models(self) -> None:
        self.get_models_dialog = open_get_models(
            self, self.dirs.models, self.model.load_model, self.model.measured_decode
        )

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

    @Slot()
    def _copy_server_url(self) -> None:
        QGuiApplication.clipboard().setText(self.local_server.url)
        self.notice.show_message(f"Copied {self.local_server.url}.", error=False)

    @Slot(str)
    def _on_appearance(self, choice: str) -> None:
        app = QApplication.instance()
        if isinstance(app, SparkApplication):
            app.set_appearance(choice)
        self.chat.restyle()  # its HTML holds the colours it was drawn with

    def _window_menu_titles(self) -> list[tuple[str, str]]:
        return [(e.id, e.title) for e in self.library.entries()[:9]]

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        urls: list[QUrl] = event.mimeData().urls()
        event.acceptProposedAction()
        self.conversation.handle_drop([Path(u.toLocalFile()) for u in urls if u.isLocalFile()], len(urls))

    def closeEvent(self, event: QCloseEvent) -> None:
        # Nothing to ask: the conversation is stored as it changes (and once more on quit).
        self.prefs.set_window(self.saveGeometry(), self.saveState())
        self.prefs.set_last_conversation(self.state.current_id)
        super().closeEvent(event)

    @Slot()
    def _on_quit(self) -> None:
        self.shutdown()
        QApplication.quit()

    def shutdown(self, wait_ms: int = 30_000) -> bool:
        """Remember the layout and the open conversation, stop any reply, store it, end both worker threads (both
        at once, each within `wait_ms`); False when a worker is still busy then (a model still loading: nothing of
        it needs keeping, so Quit need not wait for it)."""
        if self._shut_down:
            return self.workers_done
        self._shut_down = True
        self.conversation.shut_down()
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


def _separator() -> QFrame:
    line = QFrame()
    line.setObjectName("separator")
    line.setFrameShape(QFrame.Shape.HLine)
    line.setFrameShadow(QFrame.Shadow.Plain)
    return line
