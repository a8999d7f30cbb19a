"""The sampling knobs as one widget (temperature, top-k/p, min-p, repetition penalty, seed, greedy): Settings and a
conversation's Sampling sheet both show it. It owns the values it shows; its owner says which rows may be edited."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Slot
from PySide6.QtWidgets import QCheckBox, QDoubleSpinBox, QFormLayout, QSpinBox, QWidget

from engine import SamplingSettings

RANDOM_SEED = -1  # the spin box's special value shown as "Random"


def _double(lo: float, hi: float, step: float, decimals: int = 2) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(lo, hi)
    box.setSingleStep(step)
    box.setDecimals(decimals)
    return box


class SamplingForm(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
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
        self._window = SamplingSettings().repetition_window  # not shown: kept from the values shown last
        self._knobs_editable = self._seed_editable = True
        # Public: an owner adds its own rows here, so every label lines up in one column.
        self.rows = form = QFormLayout(self)
        form.setContentsMargins(0, 0, 0, 0)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.FieldsStayAtSizeHint)
        form.addRow("Temperature:", self.temperature)
        form.addRow("Top-k:", self.top_k)
        form.addRow("Top-p:", self.top_p)
        form.addRow("Min-p:", self.min_p)
        form.addRow("Repetition penalty:", self.repetition)
        form.addRow("Seed:", self.seed)
        form.addRow("Greedy:", self.greedy)
        self.greedy.toggled.connect(self._on_greedy)

    def show_values(self, s: SamplingSettings) -> None:
        """Every row, the seed and greedy switch included."""
        self.seed.setValue(RANDOM_SEED if s.seed is None else s.seed)
        self.greedy.setChecked(s.greedy)
        self.show_knobs(s)

    def show_knobs(self, s: SamplingSettings) -> None:
        """The knobs a model's defaults give (the seed and greedy switch stay as they are)."""
        self.temperature.setValue(s.temperature)
        self.top_k.setValue(s.top_k)
        self.top_p.setValue(s.top_p)
        self.min_p.setValue(s.min_p)
        self.repetition.setValue(s.repetition_penalty)
        self._window = s.repetition_window

    def seed_value(self) -> int | None:
        return None if self.seed.value() == RANDOM_SEED else self.seed.value()

    def value(self) -> SamplingSettings:
        return SamplingSettings(
            temperature=self.temperature.value(),
            top_k=self.top_k.value(),
            top_p=self.top_p.value(),
            min_p=self.min_p.value(),
            repetition_penalty=self.repetition.value(),
            repetition_window=self._window,
            seed=self.seed_value(),
            greedy=self.greedy.isChecked(),
        )

    def with_seed_and_greedy(self, s: SamplingSettings) -> SamplingSettings:
        """`s` with this form's seed and greedy switch (the user's own whichever knobs apply)."""
        return replace(s, seed=self.seed_value(), greedy=self.greedy.isChecked())

    def set_editable(self, knobs: bool, seed_and_greedy: bool) -> None:
        self._knobs_editable, self._seed_editable = knobs, seed_and_greedy
        self._enable()

    def _enable(self) -> None:
        # Greedy decoding ignores every knob but the repetition penalty, and the seed: those grey out with it.
        greedy = self.greedy.isChecked()
        for w in (self.temperature, self.top_k, self.top_p, self.min_p):
            w.setEnabled(self._knobs_editable and not greedy)
        self.repetition.setEnabled(self._knobs_editable)
        self.seed.setEnabled(self._seed_editable and not greedy)
        self.greedy.setEnabled(self._seed_editable)

    @Slot(bool)
    def _on_greedy(self, _greedy: bool) -> None:
        self._enable()
