"""The look: one designed palette for light and one for dark mode, following the system's choice (and its
changes), and the style sheet that reads its colours from them.

The style sheet (resources/style/spark.qss) names colours as `@name@`; each scheme fills them in, and the same
colours become the application palette, so widgets the sheet does not touch (menus, dialogs) match. On macOS the
native style draws the controls; the palette and sheet only colour the app's own surfaces.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from engine.paths import resources_dir

STYLE_SHEET = "style/spark.qss"


class Scheme(Enum):
    LIGHT = "light"
    DARK = "dark"


@dataclass(frozen=True)
class Colours:
    window: str  # sidebar, inspector, toolbar
    base: str  # the chat, fields
    text: str
    dim: str  # secondary text: dates, notes, labels
    accent: str  # links, focus, the send button
    accent_text: str  # text on the accent
    selection: str  # the sidebar's selected row
    bubble: str  # the user's messages
    code: str  # code blocks, inline code
    border: str
    info: str  # the notice bar
    info_text: str
    error: str
    error_text: str


LIGHT = Colours(
    window="#f3f3f5",
    base="#ffffff",
    text="#1d1d1f",
    dim="#6e6e73",
    accent="#0a66d9",
    accent_text="#ffffff",
    selection="#dce6f7",
    bubble="#eef3fb",
    code="#f4f4f6",
    border="#d9d9de",
    info="#e8f1fd",
    info_text="#0b4a8b",
    error="#fdecea",
    error_text="#8a1c14",
)
DARK = Colours(
    window="#232326",
    base="#1b1b1d",
    text="#ececf0",
    dim="#98989f",
    accent="#4c9bff",
    accent_text="#0b1a2e",
    selection="#2f3f58",
    bubble="#24303f",
    code="#2a2a2e",
    border="#3a3a3f",
    info="#1d3350",
    info_text="#cfe3ff",
    error="#4a1f1c",
    error_text="#ffd7d2",
)


def system_scheme() -> Scheme:
    hints = QGuiApplication.styleHints()
    return Scheme.DARK if hints.colorScheme() == Qt.ColorScheme.Dark else Scheme.LIGHT


def palette_for(c: Colours) -> QPalette:
    p = QPalette()
    role = QPalette.ColorRole
    for r, value in (
        (role.Window, c.window),
        (role.Base, c.base),
        (role.AlternateBase, c.code),
        (role.Text, c.text),
        (role.WindowText, c.text),
        (role.ButtonText, c.text),
        (role.Button, c.base),
        (role.PlaceholderText, c.dim),
        (role.Highlight, c.accent),
        (role.HighlightedText, c.accent_text),
        (role.Link, c.accent),
        (role.LinkVisited, c.accent),
        (role.ToolTipBase, c.base),
        (role.ToolTipText, c.text),
        (role.Mid, c.border),
        (role.Midlight, c.border),
    ):
        p.setColor(r, QColor(value))
    for r in (role.Text, role.WindowText, role.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, r, QColor(c.dim))
    return p


def style_sheet(c: Colours) -> str:
    sheet = (resources_dir() / STYLE_SHEET).read_text(encoding="utf-8")
    for name, value in asdict(c).items():
        sheet = sheet.replace(f"@{name}@", value)
    return sheet


def apply(app: QApplication, scheme: Scheme | None = None) -> Scheme:
    """Colour the app for `scheme` (None: the system's); returns the scheme applied."""
    scheme = scheme or system_scheme()
    colours = DARK if scheme is Scheme.DARK else LIGHT
    app.setPalette(palette_for(colours))
    app.setStyleSheet(style_sheet(colours))
    return scheme
