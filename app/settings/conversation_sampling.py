"""Chat ▸ Sampling for This Conversation…: a small sheet that gives the open conversation its own sampling — follow
the app's setting (the default), the model's defaults, or values of its own — kept with the conversation."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Slot
from PySide6.QtWidgets import (
    QButtonGroup,
    QDialog,
    QDialogButtonBox,
    QLabel,
    QRadioButton,
    QVBoxLayout,
    QWidget,
)

from app.settings.sampling_choice import SamplingChoice, knob_words, resolve, resolved_words
from app.settings.sampling_form import SamplingForm
from engine import InvalidSamplingSettings, ModelSampling, SamplingSettings


@dataclass(frozen=True)
class SamplingEdit:
    """The sheet's answer: the conversation's own choice (None: it follows the app's setting)."""

    choice: SamplingChoice | None


class ConversationSamplingDialog(QDialog):
    def __init__(
        self,
        current: SamplingChoice | None,
        app: SamplingChoice,
        model_defaults: ModelSampling | None,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Sampling for This Conversation")
        self._model_defaults = model_defaults
        self._own = (current or app).own  # the values shown to edit under "Use these settings"
        # A conversation without values of its own starts "Use these settings" from the ones its replies use now
        # (the model's defaults where those answer), not from the generic 1.0s.
        custom = current is not None and not current.use_model_defaults
        self._in_use = None if custom else resolve(app, current, model_defaults).sampling
        self._app_values = resolve(app, None, model_defaults).sampling  # what following the app gives now
        self._shown: QRadioButton | None = None  # the choice the form shows values for
        self.follow_app = QRadioButton("Use the app's setting")
        self.model = QRadioButton("Use the model's defaults")
        self.custom = QRadioButton("Use these settings for this conversation:")
        app_words = resolved_words(resolve(app, None, model_defaults)).removeprefix("the app setting: ")
        app_note = QLabel(f"As in Settings: {app_words}.")
        model_note = QLabel(
            f"{knob_words(model_defaults).capitalize()} (from {model_defaults.described})."
            if model_defaults is not None
            else "No local model is loaded: a server's model gets the values below."
        )
        for note in (app_note, model_note):
            note.setWordWrap(True)
            note.setObjectName("hint")
            note.setIndent(22)  # under its button's text
        self.form = SamplingForm()
        self.error = QLabel()
        self.error.setObjectName("dialogError")
        self.error.setWordWrap(True)
        self.error.hide()
        group = QButtonGroup(self)
        for b in (self.follow_app, self.model, self.custom):
            group.addButton(b)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel | QDialogButtonBox.StandardButton.Ok)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        intro = QLabel("How Spark picks the words of this conversation's replies. Other conversations are not changed.")
        intro.setWordWrap(True)
        layout = QVBoxLayout(self)
        for w in (intro, self.follow_app, app_note, self.model, model_note, self.custom, self.form, self.error):
            layout.addWidget(w)
        layout.addWidget(buttons)
        (self.follow_app if current is None else self.model if current.use_model_defaults else self.custom).setChecked(
            True
        )
        group.buttonToggled.connect(self._on_mode)
        self._on_mode()

    def edit(self) -> SamplingEdit:
        if self.follow_app.isChecked():
            return SamplingEdit(None)
        return SamplingEdit(SamplingChoice(self.model.isChecked(), self._shown_own()))

    def _shown_own(self) -> SamplingSettings:
        # Under "the model's defaults" the knobs show the model's values: the own ones stay as they were.
        return self.form.value() if self.custom.isChecked() else self.form.with_seed_and_greedy(self._own)

    def accept(self) -> None:
        choice = self.edit().choice
        try:
            if choice is not None:
                choice.own.validate()
        except InvalidSamplingSettings as exc:
            self.error.setText(str(exc))
            self.error.show()
            return
        super().accept()

    @Slot()
    def _on_mode(self) -> None:
        # The form shows what a reply would use: the app's values or the model's (greyed), or this conversation's
        # own (to edit). Edits made under the previous choice are kept to come back to.
        if self._shown is self.custom:
            self._own = self.form.value()
        elif self._shown is self.model:
            self._own = self.form.with_seed_and_greedy(self._own)
        if self.custom.isChecked() and self._in_use is not None:
            self._own, self._in_use = self._in_use, None
        if self.follow_app.isChecked():
            self.form.show_values(self._app_values)
        else:
            self.form.show_values(self._own)
            if self.model.isChecked() and self._model_defaults is not None:
                self.form.show_knobs(SamplingSettings.from_model(self._model_defaults))
        self._shown = self.custom if self.custom.isChecked() else self.model if self.model.isChecked() else None
        self.form.set_editable(knobs=self.custom.isChecked(), seed_and_greedy=not self.follow_app.isChecked())
