"""The window's actions (with their shortcuts), its menus, toolbar and model picker, and the commands only menus give:
open a model, add a server, weight precision, settings, edit, help, about, quit."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Qt, Slot
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QApplication, QMenu, QSizePolicy, QToolBar, QToolButton, QWidget

from app.models import downloaded_models, open_get_models
from app.worker_types import remote_name
from engine.backends import QUANTIZE_CHOICES
from engine.loading.model_files import DEFAULT_MODEL_NAME
from engine.paths import APP_NAME

if TYPE_CHECKING:
    from app.main_window import MainWindow

PRECISION_WORDS = {
    "auto": "Automatic (as the file stores it; 8-bit blocks for a folder)",
    "none": "Full precision (fp32 on the CPU)",
    "q8_0": "8-bit blocks (Q8_0)",
    "q5_0": "5-bit blocks (Q5_0)",
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


class WindowMenus(QObject):
    """Builds the window's actions, menu bar and toolbar; the model menu is refilled each time it opens."""

    def __init__(self, window: MainWindow) -> None:
        super().__init__(window)
        self._w = window
        self._build_actions()
        self._build_menus_and_toolbar()

    def _action(
        self, text: str, slot: Callable[[], object], keys: list[QKeySequence] | None = None, tip: str = ""
    ) -> QAction:
        action = QAction(text, self._w)
        if keys:
            action.setShortcuts(keys)
        if tip:
            shortcut = shortcut_text(action)
            action.setToolTip(f"{tip} ({shortcut})" if shortcut else tip)
        action.triggered.connect(slot)
        self._w.addAction(action)  # shortcuts work even where the menu bar is hidden
        return action

    def _build_actions(self) -> None:
        SK = QKeySequence.StandardKey
        self.new_chat_action = self._action(
            "New Chat", self._w.commands.new_chat, _keys(SK.New, "Ctrl+N"), "Start a new conversation"
        )
        self.open_action = self._action("Open…", self._w.commands.open_session, _keys(SK.Open, "Ctrl+O"))
        self.save_action = self._action("Save a Copy…", self._w.commands.save, _keys(SK.Save, "Ctrl+S"))
        self.save_full_action = self._action(
            "Save a Copy with Full Memory…",
            lambda: self._w.commands.save(full_memory=True),
            _keys(SK.SaveAs, "Ctrl+Shift+S"),
        )
        self.export_md_action = self._action(
            "Export as Markdown…", lambda: self._w.commands.export(self._w.current_id, "md")
        )
        self.export_json_action = self._action(
            "Export as JSON…", lambda: self._w.commands.export(self._w.current_id, "json")
        )
        self.open_model_action = self._action(
            "Open Model…", self._on_open_model, [QKeySequence("Ctrl+Alt+O")], "Load a model folder or a .gguf file"
        )
        self.open_model_folder_action = self._action("Open Model Folder…", self._on_open_model_folder)
        self.get_models_action = self._action(
            "Get Models…", self._on_get_models, tip="Download Qwen3, Gemma 3, Llama or Phi models from Hugging Face"
        )
        self.add_server_action = self._action(
            "Add a Server…", self._on_add_server, tip="Chat with a model on an OpenAI-compatible server"
        )
        self.close_action = self._action("Close Window", self._w.close, _keys(SK.Close, "Ctrl+W"))
        self.quit_action = self._action("Quit MLoT Spark", self._on_quit, _keys(SK.Quit, "Ctrl+Q"))
        self.quit_action.setMenuRole(QAction.MenuRole.QuitRole)
        self.undo_action = self._action("Undo", self._w.commands.undo, _keys(SK.Undo, "Ctrl+Z"))
        self.undo_action.setEnabled(False)
        self.copy_action = self._action("Copy", lambda: self._edit("copy"), _keys(SK.Copy, "Ctrl+C"))
        self.select_all_action = self._action(
            "Select All", lambda: self._edit("selectAll"), _keys(SK.SelectAll, "Ctrl+A")
        )
        self.find_action = self._action("Find Conversation…", self._w.commands.find, _keys(SK.Find, "Ctrl+F"))
        self.rename_action = self._action("Rename Conversation…", lambda: self._w.commands.rename(self._w.current_id))
        self.duplicate_action = self._action(
            "Duplicate Conversation", lambda: self._w.commands.duplicate(self._w.current_id)
        )
        self.delete_action = self._action(
            "Delete Conversation", lambda: self._w.commands.delete(self._w.current_id), [QKeySequence("Ctrl+Backspace")]
        )
        self.settings_action = self._action(
            "Settings…", self._on_settings, _keys(SK.Preferences, "Ctrl+,"), "Sampling settings"
        )
        self.settings_action.setMenuRole(QAction.MenuRole.PreferencesRole)
        self.stop_action = self._action("Stop", self._w.stop_reply, [QKeySequence("Ctrl+.")], "Stop the reply")
        self.regenerate_action = self._action(
            "Regenerate", self._w.regenerate, [QKeySequence("Ctrl+R")], "Answer the last prompt again"
        )
        self.quick_action = self._action("Quick Prompt…", self._w.open_quick_prompt, [QKeySequence("Ctrl+Shift+K")])
        self.sidebar_action = self._toggle(
            "Conversations",
            self._w.sidebar,
            self._w.prefs.sidebar_visible(),
            [QKeySequence("Ctrl+Shift+L")],
            self._w.prefs.set_sidebar_visible,
        )
        self.inspector_action = self._toggle(
            "Inspector",
            self._w.inspector,
            self._w.prefs.inspector_visible(),
            [QKeySequence("Ctrl+I")],
            self._remember_inspector,
        )
        self.system_prompt_action = self._toggle("System Prompt", self._w.system_row, True, None, None)
        self.about_action = self._action(f"About {APP_NAME}", self._on_about)
        self.about_action.setMenuRole(QAction.MenuRole.AboutRole)
        self.help_action = self._action(f"{APP_NAME} Help", self._on_help, _keys(SK.HelpContents, "F1"))
        self.switch_actions = [
            self._action(f"Conversation {n}", partial(self._w.commands.switch_to, n), [QKeySequence(f"Ctrl+{n}")])
            for n in range(1, 10)
        ]

    def _toggle(
        self,
        text: str,
        widget: QWidget,
        on: bool,
        keys: list[QKeySequence] | None,
        remember: Callable[[bool], None] | None,
    ) -> QAction:
        action = self._action(text, lambda: None, keys, text)
        action.setCheckable(True)
        action.setChecked(on)
        widget.setVisible(on)
        action.toggled.connect(widget.setVisible)
        if remember is not None:
            action.toggled.connect(remember)
        return action

    def _remember_inspector(self, shown: bool) -> None:
        if not self._w.auto_layout:  # the user's choice, not the narrow-window rule below
            self._w.prefs.set_inspector_visible(shown)

    def _build_menus_and_toolbar(self) -> None:
        bar = self._w.menuBar()

        def menu(title: str, items: list[QAction | QMenu | None]) -> QMenu:
            m = bar.addMenu(title)
            for a in items:
                m.addSeparator() if a is None else m.addMenu(a) if isinstance(a, QMenu) else m.addAction(a)
            return m

        self.model_menu = QMenu("&Model", self._w)
        self.model_menu.aboutToShow.connect(self._fill_model_menu)
        self.precision_group = QActionGroup(self._w)
        self.precision_menu = QMenu("Weight Precision", self._w)
        for value in QUANTIZE_CHOICES:
            a = self.precision_menu.addAction(PRECISION_WORDS.get(value, value))
            a.setCheckable(True)
            a.setChecked(value == self._w.prefs.precision())
            a.setData(value)
            self.precision_group.addAction(a)
        self.precision_group.triggered.connect(self._on_precision)
        self._fill_model_menu()
        menu(
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
        menu(
            "&Edit",
            [
                self.undo_action,
                None,
                self.copy_action,
                self.select_all_action,
                None,
                self.find_action,
                self.rename_action,
                self.duplicate_action,
                self.delete_action,
                None,
                self.settings_action,
            ],
        )
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
        self._w.addToolBar(tools)

    def _fill_model_menu(self) -> None:
        m = self.model_menu
        m.clear()
        default = m.addAction(f"Default Model ({DEFAULT_MODEL_NAME})", lambda: self._w.load_model(None))
        default.setCheckable(True)
        default.setChecked(self._w.model_loaded and self._w.model_path is None and self._w.remote is None)
        recent = self._w.prefs.recent_models()
        if recent:
            m.addSection("Recent")
            for p in recent:
                a = m.addAction(p.name, partial(self._w.load_model, p))
                a.setToolTip(str(p))
                a.setCheckable(True)
                a.setChecked(p == self._w.model_path and self._w.remote is None)
        downloaded = downloaded_models(self._w.dirs.models)
        if downloaded:
            m.addSection("Downloaded")
            for name, path in downloaded:
                a = m.addAction(name, partial(self._w.load_model, path))
                a.setToolTip(str(path))
                a.setCheckable(True)
                a.setChecked(path == self._w.model_path and self._w.remote is None)
        servers = self._w.remote_servers.all()
        if servers:
            m.addSection("Servers")
            for s in servers:
                a = m.addAction(remote_name(s), partial(self._w.use_remote, s))
                a.setToolTip(s.url)
                a.setCheckable(True)
                a.setChecked(s == self._w.remote)
        m.addSeparator()
        m.addAction(self.get_models_action)
        m.addAction(self.open_model_action)
        m.addAction(self.open_model_folder_action)
        m.addAction(self.add_server_action)
        m.addSeparator()
        m.addMenu(self.precision_menu)

    @Slot()
    def _on_open_model(self) -> None:
        path = self._w.dialogs.model_file(self._model_start())
        if path is not None:
            self._w.handle_drop([path], 1)

    @Slot()
    def _on_open_model_folder(self) -> None:
        path = self._w.dialogs.model_dir(self._model_start())
        if path is not None:
            self._w.handle_drop([path], 1)

    def _model_start(self) -> Path:
        recent = self._w.prefs.recent_models()
        return recent[0].parent if recent else Path.home()

    @Slot()
    def _on_get_models(self) -> None:
        self.get_models_dialog = open_get_models(self._w, self._w.dirs.models, self._w.load_model)

    @Slot()
    def _on_add_server(self) -> None:
        server = self._w.dialogs.add_server()
        if server is not None:
            self._w.remote_servers.add(server)
            self._w.use_remote(server)

    def _on_precision(self, action: QAction) -> None:
        self._w.prefs.set_precision(str(action.data()))
        if self._w.model_loaded and self._w.remote is None:  # a remote model's precision is the server's business
            self._w.load_model(self._w.model_path)

    @Slot()
    def _on_settings(self) -> None:
        edited = self._w.dialogs.edit_settings(self._w.generation_settings())
        if edited is not None:
            self._w.prefs.set_generation(edited)

    @Slot()
    def _on_quit(self) -> None:
        self._w.shutdown()
        QApplication.quit()

    def _edit(self, what: str) -> None:
        target = QApplication.focusWidget()
        if not hasattr(target, what):
            target = self._w.chat
        getattr(target, what)()

    @Slot()
    def _on_about(self) -> None:
        self._w.dialogs.about()

    @Slot()
    def _on_help(self) -> None:
        self._w.dialogs.help(self._help_keys())

    def _help_keys(self) -> list[tuple[str, str]]:
        acts = [
            self.new_chat_action,
            self.find_action,
            self.delete_action,
            self.inspector_action,
            self.stop_action,
            self.regenerate_action,
            self.undo_action,
            self.switch_actions[0],
        ]
        return [(a.text().replace("Conversation 1", "Conversation 1…9"), shortcut_text(a)) for a in acts]
