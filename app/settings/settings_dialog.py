"""Settings (⌘,): how replies are sampled (the model's own defaults, shown with where they came from, or the user's
override: temperature, top-k/p, min-p, repetition penalty; seed, greedy, reply length), whether replies are sped up by speculation, the MCP servers whose tools the model may call, and the local
server's switch."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Slot
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.settings.tool_servers import ToolServerError, parse_servers, servers_text
from app.tools.mcp_host import McpServerSpec
from engine import GenerationSettings, InvalidSamplingSettings, ModelSampling, SamplingSettings, Speculation

RANDOM_SEED = -1  # the spin box's special value shown as "Random"


def uses_model_defaults(sampling: SamplingSettings) -> bool:
    """Whether `sampling` asks for the model's own defaults: the generic settings in every knob the model's defaults
    give (seed and greedy are the user's own either way). app.worker.conversation substitutes the model's."""
    return replace(sampling, seed=None, greedy=False) == SamplingSettings()


def describe(m: ModelSampling) -> str:
    """The model's defaults in one line, with where they came from."""
    knobs = [
        "greedy" if m.greedy else f"temperature {m.temperature:g}",
        f"top-p {m.top_p:g}" if m.top_p < 1.0 else "top-p off",
        f"top-k {m.top_k}" if m.top_k else "top-k off",
        f"min-p {m.min_p:g}" if m.min_p else "min-p off",
        f"repetition penalty {m.repetition_penalty:g} over {m.repetition_window} tokens"
        if m.repetition_penalty != 1.0
        else "no repetition penalty",
    ]
    return f"{', '.join(knobs)} (from {m.described})."


def _double(lo: float, hi: float, step: float, decimals: int = 2) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(lo, hi)
    box.setSingleStep(step)
    box.setDecimals(decimals)
    return box


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
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self._model_defaults = model_defaults  # None: no local model loaded (a server's model, or none yet)
        self.use_model_defaults = QCheckBox("Use the model's defaults")
        self.model_defaults_note = QLabel(
            describe(model_defaults)
            if model_defaults is not None
            else "No local model is loaded: its own defaults apply once one is."
        )
        self.model_defaults_note.setWordWrap(True)
        self.temperature = _double(0.0, 2.0, 0.05)
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 1000)
        self.top_k.setSpecialValueText("Off")
        self.top_p = _double(0.01, 1.0, 0.05)
        self.min_p = _double(0.0, 1.0, 0.01)
        self.min_p.setSpecialValueText("Off")
        self.repetition = _double(0.5, 2.0, 0.05)
        self.seed = QSpinBox()
        self.seed.setRange(RANDOM_SEED, 2**31 - 1)
        self.seed.setSpecialValueText("Random")
        self.greedy = QCheckBox("Always pick the most likely token")
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 32768)
        self.max_tokens.setSuffix(" tokens")
        # Prompt lookup, adaptive (Speculation.AUTO): greedy replies are the same, sampled ones keep their odds.
        self.speculative = QCheckBox("Speed up replies by reusing text from the conversation (speculative decoding)")
        self.error = QLabel()
        self.error.setObjectName("dialogError")
        self.error.setWordWrap(True)
        self.error.hide()

        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.FieldsStayAtSizeHint)
        form.addRow("Sampling:", self.use_model_defaults)
        form.addRow("", self.model_defaults_note)
        form.addRow("Temperature:", self.temperature)
        form.addRow("Top-k:", self.top_k)
        form.addRow("Top-p:", self.top_p)
        form.addRow("Min-p:", self.min_p)
        form.addRow("Repetition penalty:", self.repetition)
        form.addRow("Seed:", self.seed)
        form.addRow("Greedy:", self.greedy)
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
        self.greedy.toggled.connect(self._on_greedy_toggled)
        self.use_model_defaults.toggled.connect(self._on_model_defaults_toggled)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        self.serve: QCheckBox | None = None
        if server is not None:
            layout.addWidget(self._server_group(*server))
        self.tools = QPlainTextEdit(servers_text(tool_servers or []))
        layout.addWidget(self._tools_group())
        layout.addWidget(self.error)
        layout.addWidget(buttons)
        self._show(settings)

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
        seed = None if self.seed.value() == RANDOM_SEED else self.seed.value()
        if self.use_model_defaults.isChecked():  # the generic knobs stand for "the model's own" (uses_model_defaults)
            sampling = SamplingSettings(seed=seed, greedy=self.greedy.isChecked())
        else:
            sampling = SamplingSettings(
                temperature=self.temperature.value(),
                top_k=self.top_k.value(),
                top_p=self.top_p.value(),
                min_p=self.min_p.value(),
                repetition_penalty=self.repetition.value(),
                repetition_window=self._model_defaults.repetition_window if self._model_defaults else 64,
                seed=seed,
                greedy=self.greedy.isChecked(),
            )
        speculative = Speculation.AUTO if self.speculative.isChecked() else Speculation.OFF
        return GenerationSettings(max_tokens=self.max_tokens.value(), sampling=sampling, speculative=speculative)

    def accept(self) -> None:
        try:
            self.value().sampling.validate()
            self.tool_servers()
        except (InvalidSamplingSettings, ToolServerError) as exc:
            self.error.setText(str(exc))
            self.error.show()
            return
        super().accept()

    def _show(self, settings: GenerationSettings) -> None:
        s = settings.sampling
        self.seed.setValue(RANDOM_SEED if s.seed is None else s.seed)
        self.greedy.setChecked(s.greedy)
        self.max_tokens.setValue(settings.max_tokens)
        self.speculative.setChecked(settings.speculative != Speculation.OFF)
        own = uses_model_defaults(s)
        self.use_model_defaults.setChecked(own)
        self._show_knobs(self._defaults_shown() if own else s)
        self._enable_knobs()

    def _defaults_shown(self) -> SamplingSettings:
        """The knobs' values while the model's defaults are in use: the model's own (the generic without a model)."""
        return SamplingSettings.from_model(self._model_defaults) if self._model_defaults else SamplingSettings()

    def _show_knobs(self, s: SamplingSettings) -> None:
        self.temperature.setValue(s.temperature)
        self.top_k.setValue(s.top_k)
        self.top_p.setValue(s.top_p)
        self.min_p.setValue(s.min_p)
        self.repetition.setValue(s.repetition_penalty)

    def _enable_knobs(self) -> None:
        # Greedy decoding ignores every sampling knob, and the model's defaults are not edited here: greyed out.
        greedy, own = self.greedy.isChecked(), self.use_model_defaults.isChecked()
        for w in (self.temperature, self.top_k, self.top_p, self.min_p):
            w.setEnabled(not greedy and not own)
        self.repetition.setEnabled(not own)
        self.seed.setEnabled(not greedy)

    @Slot()
    def _on_restore_defaults(self) -> None:
        self._show(replace(GenerationSettings(), max_tokens=self.max_tokens.value()))

    @Slot(bool)
    def _on_greedy_toggled(self, _greedy: bool) -> None:
        self._enable_knobs()

    @Slot(bool)
    def _on_model_defaults_toggled(self, own: bool) -> None:
        # Back to the model's own: its values reappear. Overriding starts from them, so one knob changes at a time.
        if own:
            self._show_knobs(self._defaults_shown())
        self._enable_knobs()
