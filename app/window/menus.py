"""The window's actions (with their shortcuts), its menus, toolbar and model picker, and the commands only menus give:
open a model, add a server, weight precision, settings, help, about.

The menus know the window's `WindowState`, the preferences, the saved servers and the dialogs, never the window:
the window connects the actions it acts on, and hears the menus' own choices through their signals. Each menu is
built by one method, so a new entry (a model library, a server switch) is one line where it belongs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from PySide6.QtCore import QObject, QSize, Qt, Signal, Slot
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QLineEdit,
    QMainWindow,
    QMenu,
    QPlainTextEdit,
    QSizePolicy,
    QTextEdit,
    QToolBar,
    QToolButton,
    QWidget,
)

from app.misc.ui_icons import icon
from app.settings.preferences import Preferences
from app.settings.remote_servers import RemoteServerList
from app.window.dialogs import Dialogs
from app.window.state import WindowState
from app.worker.types import remote_name
from engine import DEFAULT_MODEL_NAME, QUANTIZE_CHOICES, RemoteServer
from engine.paths import APP_NAME

PRECISION_WORDS = {
    "auto": "Automatic (as the file stores it; 8-bit blocks for a folder)",
    "none": "Full precision (fp32 on the CPU)",
    "q8_0": "8-bit blocks (Q8_0)",
    "q5_0": "5-bit blocks (Q5_0)",
    "q4_1": "4-bit blocks with offsets (Q4_1)",
    "q4_0": "4-bit blocks (Q4_0)",
}
if sys.platform == "darwin":  # int8 weights run on the Neural Engine: offered only where there is one
    PRECISION_WORDS["int8"] = "8-bit for the Neural Engine (int8)"


TOOLBAR_ICONS = {  # action attribute -> icon (resources/icons/ui)
    "sidebar_action": "sidebar",
    "new_chat_action": "new-chat",
    "regenerate_action": "regenerate",
    "stop_action": "stop",
    "inspector_action": "inspector",
    "settings_action": "settings",
}
APPEARANCE_WORDS = {"system": "System", "light": "Light", "dark": "Dark"}


def _spacer() -> QWidget:
    spacer = QWidget()
    spacer.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
    return spacer


def shortcut_text(action: QAction) -> str:
    """The action's shortcut as this platform writes it (⌘N on macOS, Ctrl+N elsewhere)."""
    return action.shortcut().toString(QKeySequence.SequenceFormat.NativeText)


def _keys(standard: QKeySequence.StandardKey, fallback: str) -> list[QKeySequence]:
    """The platform's binding for a standard action, or `fallback` (Ctrl = ⌘ on macOS) where it has none."""
    return QKeySequence.keyBindings(standard) or [QKeySequence(fallback)]


class WindowMenus(QObject):
    """Builds the window's actions, menu bar and toolbar; the model menu is refilled each time it opens."""

    model_chosen = Signal(object)  # Path | None (the default model)
    model_path_chosen = Signal(Path)  # a file or folder picked in Open Model (checked by the window)
    server_chosen = Signal(RemoteServer)
    precision_changed = Signal(str)
    conversation_chosen = Signal(str)  # an id from the Window menu
    tool_servers_changed = Signal()  # Settings changed the MCP servers (kept in the preferences)
    sampling_changed = Signal()  # Settings were accepted: the app's sampling may have changed
    reply_json_toggled = Signal(bool)  # Chat ▸ Reply as JSON, for the open conversation (the window keeps it)
    json_schema_requested = Signal()  # Chat ▸ JSON Schema…
    appearance_chosen = Signal(str)  # View ▸ Appearance: "system", "light" or "dark" (kept in the preferences)

    def __init__(
        self,
        host: QMainWindow,
        state: WindowState,
        prefs: Preferences,
        servers: RemoteServerList,
        dialogs: Dialogs,
        text_fallback: QWidget,
        titles: Callable[[], list[tuple[str, str]]],
        downloaded: Callable[[], list[tuple[str, Path]]] = list,
    ) -> None:
        super().__init__(host)
        self._host = host
        self._state = state
        self._prefs = prefs
        self._servers = servers
        self._dialogs = dialogs
        self._text_fallback = text_fallback  # where Copy/Select All go when the focus holds no text
        self._titles = titles  # the conversations the Window menu lists: (id, title), newest first
        self._downloaded = downloaded  # the model library's complete downloads: (name, GGUF path)
        self.model_menu_extras: list[QAction | None] = []  # entries added at the menu's end (None: a separator)
        self.server_actions: tuple[QAction, QAction] | None = None  # the local server's, shown in Settings too
        self._build_actions()
        self._build_menus_and_toolbar()

    def _action(self, text: str, keys: list[QKeySequence] | None = None, tip: str = "") -> QAction:
        action = QAction(text, self._host)
        if keys:
            action.setShortcuts(keys)
        if tip:
            shortcut = shortcut_text(action)
            action.setToolTip(f"{tip} ({shortcut})" if shortcut else tip)
        self._host.addAction(action)  # shortcuts work even where the menu bar is hidden
        return action

    def _build_actions(self) -> None:
        SK = QKeySequence.StandardKey
        self.new_chat_action = self._action("New Chat", _keys(SK.New, "Ctrl+N"), "Start a new conversation")
        self.open_action = self._action("Open…", _keys(SK.Open, "Ctrl+O"))
        self.save_action = self._action("Save a Copy…", _keys(SK.Save, "Ctrl+S"))
        self.save_full_action = self._action("Save a Copy with Full Memory…", _keys(SK.SaveAs, "Ctrl+Shift+S"))
        self.export_md_action = self._action("Export as Markdown…")
        self.export_json_action = self._action("Export as JSON…")
        self.open_model_action = self._action(
            "Open Model…", [QKeySequence("Ctrl+Alt+O")], "Load a model folder or a .gguf file"
        )
        self.open_model_action.triggered.connect(self._on_open_model)
        self.open_model_folder_action = self._action("Open Model Folder…")
        self.open_model_folder_action.triggered.connect(self._on_open_model_folder)
        self.get_models_action = self._action(
            "Get Models…", tip="Download Qwen3, Gemma 3, Llama or Phi models from Hugging Face"
        )
        self.add_server_action = self._action("Add a Server…", tip="Chat with a model on an OpenAI-compatible server")
        self.add_server_action.triggered.connect(self._on_add_server)
        self.close_action = self._action("Close Window", _keys(SK.Close, "Ctrl+W"))
        self.quit_action = self._action(f"Quit {APP_NAME}", _keys(SK.Quit, "Ctrl+Q"))
        self.quit_action.setMenuRole(QAction.MenuRole.QuitRole)
        # Edit: the focused text's own undo and clipboard; the conversation's undo (New Chat, Delete) is apart.
        self.text_undo_action = self._action("Undo", _keys(SK.Undo, "Ctrl+Z"))
        self.text_undo_action.triggered.connect(self._on_undo)
        self.text_redo_action = self._edit_action("Redo", "redo", _keys(SK.Redo, "Ctrl+Shift+Z"))
        self.cut_action = self._edit_action("Cut", "cut", _keys(SK.Cut, "Ctrl+X"))
        self.copy_action = self._edit_action("Copy", "copy", _keys(SK.Copy, "Ctrl+C"))
        self.paste_action = self._edit_action("Paste", "paste", _keys(SK.Paste, "Ctrl+V"))
        self.select_all_action = self._edit_action("Select All", "selectAll", _keys(SK.SelectAll, "Ctrl+A"))
        self.undo_action = self._action("Undo", [QKeySequence("Ctrl+Alt+Z")])  # the conversation's (⌘Z without text)
        self.undo_action.setEnabled(False)
        self.find_action = self._action("Find Conversation…", _keys(SK.Find, "Ctrl+F"))
        self.rename_action = self._action("Rename Conversation")
        self.duplicate_action = self._action("Duplicate Conversation")
        self.delete_action = self._action("Delete Conversation", [QKeySequence("Ctrl+Backspace")])
        self.settings_action = self._action("Settings…", _keys(SK.Preferences, "Ctrl+,"), "Settings")
        self.settings_action.setMenuRole(QAction.MenuRole.PreferencesRole)
        self.settings_action.triggered.connect(self._on_settings)
        self.stop_action = self._action("Stop", [QKeySequence("Ctrl+.")], "Stop the reply")
        self.regenerate_action = self._action("Regenerate", [QKeySequence("Ctrl+R")], "Answer the last prompt again")
        self.conversation_sampling_action = self._action(
            "Sampling for This Conversation…", tip="Give this conversation its own sampling settings"
        )
        self.reply_json_action = self._toggle("Reply as JSON", False, None)
        self.reply_json_action.setToolTip("This conversation's replies are JSON matching a schema you give")
        self.reply_json_action.triggered.connect(
            lambda on: self.reply_json_toggled.emit(bool(on))
        )  # the user's, not set_reply_json's
        self.json_schema_action = self._action(
            "JSON Schema…", tip="The schema this conversation's replies follow when Reply as JSON is on"
        )
        self.json_schema_action.triggered.connect(lambda: self.json_schema_requested.emit())
        self.quick_action = self._action("Quick Prompt…", [QKeySequence("Ctrl+Shift+K")])
        self.minimize_action = self._action("Minimize", [QKeySequence("Ctrl+M")])
        self.minimize_action.triggered.connect(self._host.showMinimized)
        self.zoom_action = self._action("Zoom")
        self.zoom_action.triggered.connect(self._on_zoom)
        self.sidebar_action = self._toggle(
            "Conversations", self._prefs.sidebar_visible(), [QKeySequence("Ctrl+Shift+L")]
        )
        self.sidebar_action.toggled.connect(self._prefs.set_sidebar_visible)
        self.inspector_action = self._toggle("Inspector", self._prefs.inspector_visible(), [QKeySequence("Ctrl+I")])
        self.system_prompt_action = self._toggle("System Prompt", True, None)
        self.about_action = self._action(f"About {APP_NAME}")
        self.about_action.setMenuRole(QAction.MenuRole.AboutRole)
        self.about_action.triggered.connect(self._dialogs.about)
        self.help_action = self._action(f"{APP_NAME} Help", _keys(SK.HelpContents, "F1"))
        self.help_action.triggered.connect(lambda: self._dialogs.help(self._help_keys()))
        self.switch_actions = [self._action(f"Conversation {n}", [QKeySequence(f"Ctrl+{n}")]) for n in range(1, 10)]
        for n, a in enumerate(self.switch_actions):
            a.triggered.connect(partial(self._switch_to, n))

    def _edit_action(self, text: str, method: str, keys: list[QKeySequence]) -> QAction:
        action = self._action(text, keys)
        action.triggered.connect(partial(self._edit, method))
        return action

    def _toggle(self, text: str, on: bool, keys: list[QKeySequence] | None) -> QAction:
        action = self._action(text, keys, text)
        action.setCheckable(True)
        action.setChecked(on)
        return action

    def _build_menus_and_toolbar(self) -> None:
        bar = self._host.menuBar()

        def menu(title: str, items: list[QAction | QMenu | None]) -> QMenu:
            m = bar.addMenu(title)
            for a in items:
                m.addSeparator() if a is None else m.addMenu(a) if isinstance(a, QMenu) else m.addAction(a)
            return m

        self.model_menu = QMenu("&Model", self._host)
        self.model_menu.aboutToShow.connect(self._fill_model_menu)
        self.precision_group = QActionGroup(self._host)
        self.precision_menu = QMenu("Weight Precision", self._host)
        for value in QUANTIZE_CHOICES:
            if value not in PRECISION_WORDS:  # a choice only where it exists on this machine
                continue
            a = self.precision_menu.addAction(PRECISION_WORDS[value])
            a.setCheckable(True)
            a.setChecked(value == self._prefs.precision())
            a.setData(value)
            self.precision_group.addAction(a)
        self.precision_group.triggered.connect(self._on_precision)
        self._fill_model_menu()
        self.file_menu = menu(
            "&File",
            [
                self.new_chat_action,
                self.open_action,
                None,
                self.save_action,
                self.save_full_action,
                self.export_md_action,
                self.export_json_action,
                None,
                self.close_action,
                self.quit_action,
            ],
        )
        self.edit_menu = menu(
            "&Edit",
            [
                self.text_undo_action,
                self.text_redo_action,
                None,
                self.cut_action,
                self.copy_action,
                self.paste_action,
                self.select_all_action,
                None,
                self.undo_action,
                self.find_action,
                self.rename_action,
                self.duplicate_action,
                self.delete_action,
                None,
                self.settings_action,
            ],
        )
        self.chat_menu = menu(
            "&Chat",
            [
                self.stop_action,
                self.regenerate_action,
                None,
                self.conversation_sampling_action,
                self.reply_json_action,
                self.json_schema_action,
            ],
        )
        bar.addMenu(self.model_menu)
        self.appearance_menu = self._appearance_menu()
        self.view_menu = menu(
            "&View",
            [self.sidebar_action, self.inspector_action, self.system_prompt_action, None, self.appearance_menu],
        )
        self.window_menu = menu("&Window", [self.minimize_action, self.zoom_action, None, self.quick_action, None])
        self.window_menu.aboutToShow.connect(self._fill_window_menu)
        self._fill_window_menu()
        menu("&Help", [self.help_action, self.about_action])

        tools = QToolBar("Chat")
        tools.setObjectName("chatToolbar")
        tools.setMovable(False)
        # One bar of line icons (their names are the actions', for tooltips and screen readers), the model centred.
        tools.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonIconOnly)
        tools.setIconSize(QSize(20, 20))
        for action, name in TOOLBAR_ICONS.items():
            a = getattr(self, action)
            a.setIcon(icon(name))
            a.setIconVisibleInMenu(False)  # menus stay words, as on a Mac
        for a in (self.sidebar_action, self.new_chat_action):
            tools.addAction(a)
        tools.addWidget(_spacer())
        self.model_button = QToolButton()
        self.model_button.setObjectName("modelButton")
        self.model_button.setText("Model: loading…")
        self.model_button.setMenu(self.model_menu)
        self.model_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.model_button.setToolTip("Choose the model")
        self.model_button.setAccessibleName("Model")
        tools.addWidget(self.model_button)
        tools.addWidget(_spacer())
        for a in (self.regenerate_action, self.stop_action, self.inspector_action, self.settings_action):
            tools.addAction(a)
        self.toolbar = tools
        self._host.addToolBar(tools)

    def _appearance_menu(self) -> QMenu:
        """System (follows the desktop's light or dark, where Qt can read it), Light or Dark."""
        m = QMenu("Appearance", self._host)
        group = QActionGroup(self._host)
        self.appearance_actions: dict[str, QAction] = {}
        for value, text in APPEARANCE_WORDS.items():
            a = m.addAction(text)
            a.setCheckable(True)
            a.setChecked(value == self._prefs.appearance())
            a.setData(value)
            group.addAction(a)
            self.appearance_actions[value] = a
        group.triggered.connect(self._on_appearance)
        return m

    @Slot(QAction)
    def _on_appearance(self, action: QAction) -> None:
        value = str(action.data())
        self._prefs.set_appearance(value)
        self.appearance_chosen.emit(value)

    def _fill_model_menu(self) -> None:
        m = self.model_menu
        m.clear()
        st = self._state
        default = m.addAction(f"Default Model ({DEFAULT_MODEL_NAME})", lambda: self.model_chosen.emit(None))
        default.setCheckable(True)
        default.setChecked(st.model_loaded and st.model_path is None and st.remote is None)
        downloaded = self._downloaded()
        # A downloaded model is listed once, under Downloaded, even when it was also used recently.
        recent = [p for p in self._prefs.recent_models() if p not in {path for _, path in downloaded}]
        if recent:
            m.addSection("Recent")
            for p in recent:
                a = m.addAction(p.name, partial(self.model_chosen.emit, p))
                a.setToolTip(str(p))
                a.setCheckable(True)
                a.setChecked(p == st.model_path and st.remote is None)
        if downloaded:
            m.addSection("Downloaded")
            for name, path in downloaded:
                a = m.addAction(name, partial(self.model_chosen.emit, path))
                a.setToolTip(str(path))
                a.setCheckable(True)
                a.setChecked(path == st.model_path and st.remote is None)
        servers = self._servers.all()
        if servers:
            m.addSection("Servers")
            for s in servers:
                a = m.addAction(remote_name(s), partial(self.server_chosen.emit, s))
                a.setToolTip(s.url)
                a.setCheckable(True)
                a.setChecked(s == st.remote)
        m.addSeparator()
        m.addAction(self.get_models_action)
        m.addAction(self.open_model_action)
        m.addAction(self.open_model_folder_action)
        m.addAction(self.add_server_action)
        m.addSeparator()
        m.addMenu(self.precision_menu)
        for action in self.model_menu_extras:
            m.addSeparator() if action is None else m.addAction(action)

    def add_server_actions(self, switch: QAction, copy: QAction) -> None:
        """The local server's switch and Copy URL: at the end of the Model menu, and in Settings."""
        self.server_actions = (switch, copy)
        self.add_model_menu_entry(None)
        self.add_model_menu_entry(switch)
        self.add_model_menu_entry(copy)

    def add_model_menu_entry(self, action: QAction | None) -> None:
        """A further entry at the end of the Model menu, kept across its refills (None: a separator)."""
        self.model_menu_extras = [*self.model_menu_extras, action]
        self._fill_model_menu()

    def _fill_window_menu(self) -> None:
        """Minimize, Zoom, Quick Prompt, then the newest conversations by title (⌘1…9)."""
        for a in self.switch_actions:
            self.window_menu.removeAction(a)
        titles = self._titles()
        for (cid, title), a in zip(titles, self.switch_actions, strict=False):
            a.setText(title)
            a.setData(cid)
            a.setCheckable(True)
            a.setChecked(cid == self._state.current_id)
            self.window_menu.addAction(a)
        for a in self.switch_actions[len(titles) :]:
            a.setData(None)

    def _switch_to(self, n: int) -> None:
        titles = self._titles()
        if n < len(titles):
            self.conversation_chosen.emit(titles[n][0])

    @Slot()
    def _on_zoom(self) -> None:
        self._host.showNormal() if self._host.isMaximized() else self._host.showMaximized()

    @Slot()
    def _on_open_model(self) -> None:
        path = self._dialogs.model_file(self._model_start())
        if path is not None:
            self.model_path_chosen.emit(path)

    @Slot()
    def _on_open_model_folder(self) -> None:
        path = self._dialogs.model_dir(self._model_start())
        if path is not None:
            self.model_path_chosen.emit(path)

    def _model_start(self) -> Path:
        recent = self._prefs.recent_models()
        return recent[0].parent if recent and recent[0].parent.is_dir() else Path.home()

    @Slot()
    def _on_add_server(self) -> None:
        server = self._dialogs.add_server()
        if server is not None:
            self._servers.add(server)
            self.server_chosen.emit(server)

    def _on_precision(self, action: QAction) -> None:
        self._prefs.set_precision(str(action.data()))
        self.precision_changed.emit(str(action.data()))

    @Slot()
    def _on_settings(self) -> None:
        own = self._state.model_sampling if self._state.remote is None else None  # a server samples as it likes
        edited = self._dialogs.edit_settings(
            self._prefs.generation(),
            self._prefs.use_model_defaults(),
            self.server_actions,
            self._prefs.tool_servers(),
            own,
        )
        if edited is not None:
            self._prefs.set_generation(edited.generation)
            self._prefs.set_use_model_defaults(edited.use_model_defaults)
            self.sampling_changed.emit()
            if edited.tool_servers != self._prefs.tool_servers():
                self._prefs.set_tool_servers(edited.tool_servers)
                self.tool_servers_changed.emit()

    @Slot()
    def _on_undo(self) -> None:
        """⌘Z undoes typing where the focused field has typing to undo, else the last conversation command."""
        target = QApplication.focusWidget()
        if (isinstance(target, QLineEdit) and target.isUndoAvailable()) or (
            isinstance(target, QPlainTextEdit | QTextEdit) and target.document().isUndoAvailable()
        ):
            target.undo()
        elif self.undo_action.isEnabled():
            self.undo_action.trigger()

    def _edit(self, method: str) -> None:
        target = QApplication.focusWidget()
        if target is None or not hasattr(target, method):
            target = self._text_fallback
        if hasattr(target, method):
            getattr(target, method)()

    def _help_keys(self) -> list[tuple[str, str]]:
        acts = [
            self.new_chat_action,
            self.find_action,
            self.delete_action,
            self.inspector_action,
            self.stop_action,
            self.regenerate_action,
            self.undo_action,
        ]
        keys = [(a.text(), shortcut_text(a)) for a in acts]
        return [*keys, ("Conversation 1…9", shortcut_text(self.switch_actions[0]).replace("1", "1…9"))]
