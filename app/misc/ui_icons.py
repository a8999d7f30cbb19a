"""The interface's icons: one set of line icons drawn for the app (resources/icons/ui/*.svg: a 24 px grid, 1.75 px
round strokes, `currentColor`), tinted at paint time with the palette in use so they follow light and dark; on macOS
SF Symbols stand in where Qt maps a theme icon to one.

`icon(name)` is all a widget needs; names are the SVG files' (new-chat, regenerate, stop, send, copy, …).
"""

from __future__ import annotations

import sys
from functools import cache

from PySide6.QtCore import QByteArray, QPoint, QRect, QSize, Qt
from PySide6.QtGui import QColor, QGuiApplication, QIcon, QIconEngine, QPainter, QPalette, QPixmap
from PySide6.QtSvg import QSvgRenderer

from engine.paths import resources_dir

UI_ICONS = "icons/ui"
# SF Symbols through Qt's theme icons on macOS (Qt maps these to symbols there); the rest use the drawn set.
MAC_SYMBOLS = {
    "copy": QIcon.ThemeIcon.EditCopy,
    "stop": QIcon.ThemeIcon.MediaPlaybackStop,
    "regenerate": QIcon.ThemeIcon.ViewRefresh,
    "send": QIcon.ThemeIcon.GoUp,
    "new-chat": QIcon.ThemeIcon.DocumentNew,
}


@cache
def svg_text(name: str) -> str:
    return (resources_dir() / UI_ICONS / f"{name}.svg").read_text(encoding="utf-8")


class _TintedSvg(QIconEngine):
    """Draws an icon's SVG in a palette colour read when it is painted (so a scheme change recolours it)."""

    def __init__(self, name: str, role: QPalette.ColorRole) -> None:
        super().__init__()
        self._name = name
        self._role = role

    def colour(self, mode: QIcon.Mode) -> QColor:
        palette = QGuiApplication.palette()
        group = QPalette.ColorGroup.Disabled if mode == QIcon.Mode.Disabled else QPalette.ColorGroup.Active
        return palette.color(group, self._role)

    def paint(self, painter: QPainter, rect: QRect, mode: QIcon.Mode, state: QIcon.State) -> None:
        text = svg_text(self._name).replace("currentColor", self.colour(mode).name())
        QSvgRenderer(QByteArray(text.encode())).render(painter, rect)

    def pixmap(self, size: QSize, mode: QIcon.Mode, state: QIcon.State) -> QPixmap:
        pm = QPixmap(size)
        pm.fill(Qt.GlobalColor.transparent)
        p = QPainter(pm)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        self.paint(p, QRect(QPoint(0, 0), size), mode, state)
        p.end()
        return pm

    def clone(self) -> QIconEngine:
        return _TintedSvg(self._name, self._role)


def icon(name: str, role: QPalette.ColorRole = QPalette.ColorRole.ButtonText) -> QIcon:
    """The icon `name` in the palette's `role` colour (ButtonText; HighlightedText on an accent-filled button)."""
    symbol = MAC_SYMBOLS.get(name)
    if sys.platform == "darwin" and symbol is not None and QIcon.hasThemeIcon(symbol):
        return QIcon.fromTheme(symbol)
    svg_text(name)  # a missing file fails here, where the icon is asked for, not at paint time
    return QIcon(_TintedSvg(name, role))
