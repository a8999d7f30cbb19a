"""Settings (⌘,): how replies are sampled (the model's own defaults, shown with where they came from, or the user's
own values: temperature, top-k/p, min-p, repetition penalty; seed, greedy, reply length), whether replies are sped
up by speculation, the MCP servers whose tools the model may call, the local server's switch, and the kept
memory's disk (app.settings.kept_memory). A conversation may
override the sampling (app.settings.conversation_sampling)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from PySide6.QtCore import Slot
from PySide6.QtGui import QAction, QShowEvent
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.misc.fit import fit_wrapped_text
from app.settings.kept_memory import KeptMemoryControl, KeptMemoryGroup
from app.settings.preferences import default_generation
from app.settings.sampling_choice import knob_words
from app.settings.sampling_form import SamplingForm
from app.settings.tool_servers import ToolServerError, parse_servers, servers_text
from app.tools.mcp_host import McpServerSpec
from engine import GenerationSettings, InvalidSamplingSettings, ModelSampling, SamplingSettings, Speculation


def describe(m: ModelSampling) -> str:
    """The model's defaults in one line, with where they came from."""
    return f"{knob_words(m)} (from {m.described})."


@dataclass(frozen=True)
class EditedSettings:
    generation: GenerationSettings  # its sampling: the user's own values, kept while the model's defaults answer
    use_model_defaults: bool
    tool_servers: list[McpServerSpec]


class SettingsDialog(QDialog):
    """The reply settings, and (given its switch) the local server. Each group is a method: a further setting is
    one row in its group."""

    def __init__(
        self,
        settings: GenerationSettings,
        parent: QWidget | None = None,
        server: tuple[QAction, QAction] | None = None,
        tool_servers: list[McpServerSpec] | None = None,
        model_defaults: ModelSampling | None = None,
        use_model_defaults: bool = True,
        kept: KeptMemoryControl | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self._model_defaults = model_defaults  # None: no local model loaded (a server's model, or none yet)
        self._own = settings.sampling  # the user's own values: shown when the model's defaults are switched off
        self._showing_own = False  # the knobs show (and edit) the user's own values, not the model's
        self.use_model_defaults = QCheckBox("Use the model's defaults")
        self.model_defaults_note = QLabel(
            describe(model_defaults)
            if model_defaults is not None
            else "No local model is loaded: its own defaults apply once one is."
        )
        self.model_defaults_note.setWordWrap(True)
        self.form = SamplingForm()
        # The form's rows, by the names Settings always had (tests and callers read them).
        f = self.form
        self.temperature, self.top_k, self.top_p, self.min_p = f.temperature, f.top_k, f.top_p, f.min_p
        self.repetition, self.seed, self.greedy = f.repetition, f.seed, f.greedy
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 32768)
        self.max_tokens.setSuffix(" tokens")
        # Prompt lookup, adaptive, where it is measured to pay (Speculation.AUTO; engine.generation.speculative
        # `resolve`): greedy replies are the same tokens.
        self.speculative = QCheckBox("Speed up replies where this computer gains from it (speculative decoding)")
        self.speculative.setToolTip(
            "Drafts the next words from text already in the conversation and checks several in one step. It changes "
            "how fast replies come, not what the model writes. It runs where it is measured to pay: replies without "
            "randomness (Greedy) on a processor whose checks are cheap; other replies are written one word at a time."
        )
        self.error = QLabel()
        self.error.setObjectName("dialogError")
        self.error.setWordWrap(True)
        self.error.hide()

        form = self.form.rows
        form.insertRow(0, "Sampling:", self.use_model_defaults)
        form.insertRow(1, "", self.model_defaults_note)
        form.addRow("Longest reply:", self.max_tokens)
        form.addRow("Speed:", self.speculative)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.RestoreDefaults
            | QDialogButtonBox.StandardButton.Cancel
            | QDialogButtonBox.StandardButton.Ok
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).clicked.connect(self._on_restore_defaults)
        self.use_model_defaults.toggled.connect(self._on_model_defaults_toggled)
        layout = QVBoxLayout(self)
        layout.addWidget(self.form)
        self.serve: QCheckBox | None = None
        if server is not None:
            layout.addWidget(self._server_group(*server))
        self.tools = QPlainTextEdit(servers_text(tool_servers or []))
        layout.addWidget(self._tools_group())
        self.kept = KeptMemoryGroup(kept) if kept is not None else None
        if self.kept is not None:
            layout.addWidget(self.kept)
        layout.addWidget(self.error)
        layout.addWidget(buttons)
        self._show(settings, use_model_defaults)

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        fit_wrapped_text(self)  # the model's defaults and the hints in full at the default size

    def _server_group(self, switch: QAction, copy: QAction) -> QGroupBox:
        """The local server's switch (the Model menu's, mirrored) and its address to copy."""
        group = QGroupBox("Local Server")
        row = QHBoxLayout(group)
        self.serve = QCheckBox(switch.text())
        self.serve.setChecked(switch.isChecked())
        self.serve.toggled.connect(switch.setChecked)
        copy_button = QPushButton("Copy URL")
        copy_button.setEnabled(copy.isEnabled())
        copy_button.clicked.connect(copy.trigger)

        def follow() -> None:  # the switch may refuse (no model) or change its text once serving
            assert self.serve is not None
            self.serve.blockSignals(True)
            self.serve.setChecked(switch.isChecked())
            self.serve.setText(switch.text())
            self.serve.blockSignals(False)
            copy_button.setEnabled(copy.isEnabled())

        switch.changed.connect(follow)
        copy.changed.connect(follow)
        row.addWidget(self.serve, 1)
        row.addWidget(copy_button)
        return group

    def _tools_group(self) -> QGroupBox:
        """MCP stdio servers, one a line; every call the model makes is shown and asked about before it runs."""
        group = QGroupBox("Tool Servers (MCP)")
        box = QVBoxLayout(group)
        hint = QLabel(
            "One server a line, as name: command arguments (e.g. files: npx -y @modelcontextprotocol/server-filesystem ~/Notes). Spark asks before each call runs."
        )
        hint.setWordWrap(True)
        self.tools.setPlaceholderText("name: command arguments")
        self.tools.setMaximumHeight(80)
        box.addWidget(hint)
        box.addWidget(self.tools)
        return group

    def tool_servers(self) -> list[McpServerSpec]:
        """The servers as edited; raises ToolServerError naming a line that cannot be read."""
        return parse_servers(self.tools.toPlainText())

    def value(self) -> GenerationSettings:
        """The settings as edited; their sampling is the user's own values, kept while the model's defaults answer
        (see `edited`)."""
        own = self.form.with_seed_and_greedy(self._own) if self.use_model_defaults.isChecked() else self.form.value()
        speculative = Speculation.AUTO if self.speculative.isChecked() else Speculation.OFF
        return GenerationSettings(max_tokens=self.max_tokens.value(), sampling=own, speculative=speculative)

    def edited(self) -> EditedSettings:
        return EditedSettings(self.value(), self.use_model_defaults.isChecked(), self.tool_servers())

    def accept(self) -> None:
        try:
            self.value().sampling.validate()
            self.tool_servers()
        except (InvalidSamplingSettings, ToolServerError) as exc:
            self.error.setText(str(exc))
            self.error.show()
            return
        if self.kept is not None:
            self.kept.apply()
        super().accept()

    def _show(self, settings: GenerationSettings, use_model_defaults: bool) -> None:
        self._own, self._showing_own = settings.sampling, False
        self.form.show_values(settings.sampling)
        self.max_tokens.setValue(settings.max_tokens)
        self.speculative.setChecked(settings.speculative != Speculation.OFF)
        self.use_model_defaults.blockSignals(True)
        self.use_model_defaults.setChecked(use_model_defaults)
        self.use_model_defaults.blockSignals(False)
        self._on_model_defaults_toggled(use_model_defaults)

    def _defaults_shown(self) -> SamplingSettings:
        """The knobs' values while the model's defaults are in use: the model's own (the generic without a model)."""
        return SamplingSettings.from_model(self._model_defaults) if self._model_defaults else SamplingSettings()

    @Slot()
    def _on_restore_defaults(self) -> None:
        self._show(replace(default_generation(), max_tokens=self.max_tokens.value()), True)

    @Slot(bool)
    def _on_model_defaults_toggled(self, model: bool) -> None:
        # On: the model's values are shown, greyed (the user's edits so far are kept to come back to). Off: the
        # user's own values come back, to edit.
        if model:
            if self._showing_own:
                self._own = self.form.value()
            self.form.show_knobs(self._defaults_shown())
        else:
            self.form.show_knobs(self._own)
        self._showing_own = not model
        self.form.set_editable(knobs=not model, seed_and_greedy=True)
