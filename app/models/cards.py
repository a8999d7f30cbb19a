"""Get Models…'s recommendations as cards: the model's name, what it is good at, and badges — its download size,
whether and how well it runs on this computer (with the decoding speed estimated here), whether it thinks before it
answers — in a list the keyboard walks like any other (arrows, Return downloads)."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QVBoxLayout, QWidget

from engine.hw.memory import format_bytes
from engine.library.recommend import Fit, Recommendation

THINKING_FAMILIES = {"qwen3"}  # models that reason in a thinking block before answering
CARD_HEIGHT = 118


def _badge(text: str, kind: str = "") -> QLabel:
    b = QLabel(text)
    b.setObjectName("badge")
    b.setProperty("kind", kind)
    return b


class ModelCard(QFrame):
    def __init__(self, r: Recommendation, fit_words: str, downloaded: bool, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("modelCard")
        self.recommendation = r
        f = r.file
        self.name_label = QLabel(r.model.name)
        self.name_label.setObjectName("modelCardName")
        about = QLabel(r.model.description)
        about.setObjectName("modelCardAbout")
        about.setWordWrap(True)
        size = ("~" if f.size_approximate else "") + format_bytes(f.size_bytes)
        self.fit_words = ("★ Best pick · " if r.first_pick else "") + fit_words
        speed = f" · ~{r.tokens_per_s:.0f} tokens/s here" if r.fit is not Fit.TOO_BIG else ""
        kind = "good" if r.fit is Fit.RUNS_WELL else "bad" if r.fit in (Fit.TOO_BIG, Fit.SLOW) else ""
        badges = [
            _badge(self.fit_words + speed, kind),
            _badge("Downloaded" if downloaded else f"{size} · {f.quantization}"),
        ]
        badges.append(_badge(f"needs {format_bytes(f.memory_4k_bytes)} at 4k tokens"))
        if r.model.vision:
            badges.append(_badge("Sees images"))
        if r.model.family in THINKING_FAMILIES:
            badges.append(_badge("Thinks"))
        badges.append(_badge(r.model.license))
        row = QHBoxLayout()
        row.setSpacing(6)
        for b in badges:
            row.addWidget(b)
        row.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 12, 16, 12)
        layout.setSpacing(4)
        layout.addWidget(self.name_label)
        layout.addWidget(about)
        layout.addLayout(row)
        self.setToolTip(f"{r.model.repo}\n{f.file}")
        self.setAccessibleName(f"{r.model.name}: {self.fit_words}, {size}")

    def set_selected(self, on: bool) -> None:
        self.setProperty("selected", on)
        self.style().unpolish(self)
        self.style().polish(self)


class ModelCards(QListWidget):
    """One card per recommendation; the current row is the chosen one."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("modelCards")
        self.setSpacing(6)
        self.setVerticalScrollMode(QListWidget.ScrollMode.ScrollPerPixel)
        self.currentRowChanged.connect(self._mark)

    def fill(self, rows: list[tuple[Recommendation, str, bool]]) -> None:
        """(recommendation, its fit in words, already downloaded) for each card."""
        self.clear()
        for r, words, downloaded in rows:
            item = QListWidgetItem()
            item.setData(Qt.ItemDataRole.UserRole, (r.model.repo, r.file.file))
            item.setSizeHint(QSize(0, CARD_HEIGHT))
            self.addItem(item)
            self.setItemWidget(item, ModelCard(r, words, downloaded))

    def card(self, row: int) -> ModelCard:
        widget = self.itemWidget(self.item(row))
        assert isinstance(widget, ModelCard)
        return widget

    def chosen(self) -> tuple[str, str] | None:
        item = self.currentItem()
        data = item.data(Qt.ItemDataRole.UserRole) if item is not None else None
        return data if isinstance(data, tuple) else None

    def _mark(self, row: int) -> None:
        for i in range(self.count()):
            self.card(i).set_selected(i == row)
