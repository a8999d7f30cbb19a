"""The Think switch beside the composer: for a model whose chat template can turn its thinking on and off
(engine.generation.reasoning), whether the next replies think first. Hidden for other models (they think as they
always do, or not at all)."""

from __future__ import annotations

from PySide6.QtWidgets import QCheckBox, QWidget

from engine import ReasoningStyle, Think


class ThinkSwitch(QCheckBox):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Think", parent)
        self.setObjectName("thinkSwitch")
        self.setToolTip("Let the model think before it answers (slower, often better); its thinking shows folded")
        self.setChecked(True)
        self.hide()

    def set_model(self, style: ReasoningStyle | None) -> None:
        """Shown for a model that can switch its thinking; None (a server's model): hidden."""
        self.setVisible(style is not None and style.can_switch)

    def think(self) -> Think:
        """What the next reply asks for: on or off where the switch is shown, else the model's own default."""
        if self.isHidden():
            return Think.AUTO
        return Think.ON if self.isChecked() else Think.OFF
