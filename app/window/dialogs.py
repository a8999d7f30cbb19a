"""The modal questions the main window asks, behind one small class so tests can answer them without a human."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QAction
from PySide6.QtWidgets import QFileDialog, QInputDialog, QMessageBox, QWidget

import engine
from app.history.export import ExportForm
from app.settings.conversation_sampling import ConversationSamplingDialog, SamplingEdit
from app.settings.json_reply import SchemaDialog
from app.settings.kept_memory import KeptMemoryControl
from app.settings.remote_servers import AddServerDialog
from app.settings.sampling_choice import SamplingChoice
from app.settings.settings_dialog import EditedSettings, SettingsDialog
from app.tools.consent import Decision, PendingCall
from app.tools.mcp_host import McpServerSpec
from engine import GenerationSettings, ModelSampling, RemoteServer
from engine.paths import APP_NAME

SESSION_FILTER = "Spark conversations (*.spark)"
MODEL_FILTER = "GGUF models (*.gguf)"
EXPORT_FILTERS = {"md": "Markdown (*.md)", "json": "JSON (*.json)"}
MARKDOWN_PICTURE_FILTERS = {
    "Markdown, pictures in a folder beside it (*.md)": ExportForm.MARKDOWN,
    "Markdown, pictures inside the file (*.md)": ExportForm.MARKDOWN_INLINE,
}
HELP_TEXT = """<h3>Chatting</h3>
<p>Type in the box at the bottom and press Return; Shift+Return starts a new line. While Spark writes, the Send
button becomes Stop. A long message is read first: the reply shows how far the reading got.</p>
<h3>Nothing is lost</h3>
<p>Every conversation is stored as you chat, with the model's memory, and the app reopens where you left off.
New Chat and Delete can be undone. The sidebar lists your conversations; search it, or right-click one to
rename, duplicate, export or delete it (a Markdown export puts the pictures in a folder beside it, or inside it). "Branch" on a message starts a new conversation up to that point.</p>
<h3>Models</h3>
<p>The Model button chooses the default model, a recent one, or opens a model folder or a .gguf file (you can
also drop one on the window). "Add a Server…" chats with a model on an OpenAI-compatible server instead (vLLM,
Ollama, llama.cpp, LM Studio); the server then keeps the memory and Spark stores the transcript, pictures included
(they go to the server when "Sees images" is ticked for it). Weight Precision
trades memory for faithfulness. The inspector says what runs where.</p>
<h3>How replies are sampled</h3>
<p>Replies use the model's own recommended settings unless Settings says otherwise. Chat ▸ Sampling for This
Conversation… gives one conversation settings of its own; the inspector says which settings a reply used.</p>
<h3>Keys</h3>"""


class Dialogs:
    def __init__(self, parent: QWidget | None = None) -> None:
        self.parent = parent
        self.kept: KeptMemoryControl | None = None  # Settings shows the kept memory's disk when given (app.wiring)

    def confirm(self, title: str, text: str, accept: str) -> bool:
        box = QMessageBox(QMessageBox.Icon.Question, title, text, QMessageBox.StandardButton.Cancel, self.parent)
        ok = box.addButton(accept, QMessageBox.ButtonRole.AcceptRole)
        box.setDefaultButton(ok)
        box.exec()
        return box.clickedButton() is ok

    def save_path(self, start: Path) -> Path | None:
        name, _ = QFileDialog.getSaveFileName(self.parent, "Save a Copy", str(start), SESSION_FILTER)
        if not name:
            return None
        path = Path(name)
        return path if path.suffix == ".spark" else path.with_suffix(".spark")

    def open_path(self, start: Path) -> Path | None:
        name, _ = QFileDialog.getOpenFileName(self.parent, "Open", str(start), f"{SESSION_FILTER};;{MODEL_FILTER}")
        return Path(name) if name else None

    def model_file(self, start: Path) -> Path | None:
        name, _ = QFileDialog.getOpenFileName(self.parent, "Open Model", str(start), MODEL_FILTER)
        return Path(name) if name else None

    def export_path(self, start: Path, kind: str, pictures: bool = False) -> tuple[Path, ExportForm] | None:
        """Where to export and in which form: for Markdown with `pictures`, the format menu offers the pictures in a
        folder beside the file (first, the default) or inside it."""
        filters = MARKDOWN_PICTURE_FILTERS if kind == "md" and pictures else {EXPORT_FILTERS[kind]: ExportForm(kind)}
        name, chosen = QFileDialog.getSaveFileName(self.parent, "Export", str(start), ";;".join(filters))
        if not name:
            return None
        form = filters.get(chosen, next(iter(filters.values())))
        path = Path(name)
        return (path if path.suffix == form.suffix else path.with_suffix(form.suffix)), form

    def ask_text(self, title: str, label: str, current: str) -> str | None:
        text, ok = QInputDialog.getText(self.parent, title, label, text=current)
        return text.strip() if ok and text.strip() else None

    def about(self) -> None:
        QMessageBox.about(
            self.parent,
            f"About {APP_NAME}",
            f"<b>{APP_NAME}</b> {engine.__version__}<p>Chat with a local language model that remembers long "
            "conversations at a flat cost per token. Everything runs on this computer; nothing is sent anywhere.</p>",
        )

    def help(self, keys: list[tuple[str, str]]) -> None:
        rows = "".join(f"<tr><td>{name}</td><td>&nbsp;&nbsp;{key}</td></tr>" for name, key in keys if key)
        box = QMessageBox(
            QMessageBox.Icon.NoIcon,
            f"{APP_NAME} Help",
            HELP_TEXT + f"<table>{rows}</table>",
            QMessageBox.StandardButton.Close,
            self.parent,
        )
        box.exec()

    def model_dir(self, start: Path) -> Path | None:
        name = QFileDialog.getExistingDirectory(self.parent, "Open Model Folder", str(start))
        return Path(name) if name else None

    def add_server(self) -> RemoteServer | None:
        dialog = AddServerDialog(self.parent)
        return dialog.value() if dialog.exec() == AddServerDialog.DialogCode.Accepted else None

    def edit_settings(
        self,
        current: GenerationSettings,
        use_model_defaults: bool,
        server: tuple[QAction, QAction] | None = None,
        tool_servers: list[McpServerSpec] | None = None,
        model_defaults: ModelSampling | None = None,
    ) -> EditedSettings | None:
        """The settings and tool servers as edited (None: cancelled); `server`: the local server's switch and Copy
        URL actions."""
        dialog = SettingsDialog(
            current, self.parent, server, tool_servers, model_defaults, use_model_defaults, self.kept
        )
        if dialog.exec() != SettingsDialog.DialogCode.Accepted:
            return None
        return dialog.edited()

    def edit_conversation_sampling(
        self, current: SamplingChoice | None, app: SamplingChoice, model_defaults: ModelSampling | None
    ) -> SamplingEdit | None:
        """The conversation's own sampling as edited (None: cancelled)."""
        dialog = ConversationSamplingDialog(current, app, model_defaults, self.parent)
        if dialog.exec() != ConversationSamplingDialog.DialogCode.Accepted:
            return None
        return dialog.edit()

    def ask_tool_consent(self, call: PendingCall) -> Decision:
        """Allow once / Always for this server / Deny, for a call the model made (closing the box denies)."""
        box = QMessageBox(
            QMessageBox.Icon.Question,
            "Run a Tool?",
            f"The model wants to call a tool:\n\n{call.summary()}",
            QMessageBox.StandardButton.NoButton,
            self.parent,
        )
        once = box.addButton("Allow Once", QMessageBox.ButtonRole.AcceptRole)
        always = box.addButton(f"Always for {call.server}", QMessageBox.ButtonRole.AcceptRole)
        deny = box.addButton("Deny", QMessageBox.ButtonRole.RejectRole)
        box.setDefaultButton(deny)
        box.setEscapeButton(deny)
        box.exec()
        clicked = box.clickedButton()
        return (
            Decision.ALLOW_ONCE
            if clicked is once
            else Decision.ALWAYS_FOR_SERVER
            if clicked is always
            else Decision.DENY
        )

    def edit_schema(self, current: str) -> str | None:
        """The JSON schema replies follow, as edited and checked (None: cancelled)."""
        dialog = SchemaDialog(current, self.parent)
        return dialog.value() if dialog.exec() == SchemaDialog.DialogCode.Accepted else None
