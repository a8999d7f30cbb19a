"""No dialog of the app puts icons on its buttons (OK, Cancel, Close...), as on a Mac, even under a style that asks
for them (Qt's Fusion under a Linux desktop's platform theme does)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import (
    QApplication,
    QDialog,
    QDialogButtonBox,
    QMessageBox,
    QProxyStyle,
    QPushButton,
    QStyle,
    QStyleFactory,
    QStyleHintReturn,
    QStyleOption,
    QWidget,
)

from app.application import SparkApplication
from app.misc import theme
from app.settings.sampling_choice import SamplingChoice
from app.tools.consent import PendingCall
from app.window.dialogs import Dialogs
from engine import GenerationSettings


class IconsOnButtons(QProxyStyle):
    """Fusion, answering as a Linux desktop's platform theme does: dialog buttons have icons."""

    def styleHint(
        self,
        hint: QStyle.StyleHint,
        option: QStyleOption | None = None,
        widget: QWidget | None = None,
        returnData: QStyleHintReturn | None = None,
    ) -> int:
        if hint == QStyle.StyleHint.SH_DialogButtonBox_ButtonsHaveIcons:
            return 1
        return super().styleHint(hint, option, widget, returnData)


@pytest.fixture
def icon_style(qapp: SparkApplication) -> Iterator[None]:
    before = qapp.style().name() or "fusion"
    qapp.setStyle(IconsOnButtons(QStyleFactory.create("fusion")))
    theme.apply(qapp, qapp.scheme)  # the app's style sheet over it, as at launch
    yield
    qapp.setStyle(QStyleFactory.create(before))
    theme.apply(qapp, qapp.scheme)


def buttons_of(dialog: QWidget) -> list[QPushButton]:
    return [b for box in dialog.findChildren(QDialogButtonBox) for b in box.findChildren(QPushButton)]


def shown_buttons(ask: Callable[[], Any]) -> list[tuple[str, bool]]:
    """Run `ask` (which opens a modal dialog and waits); record (text, has an icon) of the dialog's buttons, then
    close it."""
    seen: list[tuple[str, bool]] = []

    def look() -> None:
        dialog = QApplication.activeModalWidget()
        if dialog is None:  # not shown yet
            QTimer.singleShot(10, look)
            return
        seen.extend((b.text(), not b.icon().isNull()) for b in buttons_of(dialog))
        if isinstance(dialog, QDialog):
            dialog.reject()
        else:
            dialog.close()

    QTimer.singleShot(0, look)
    ask()
    return seen


def test_the_style_under_test_would_put_icons_on_buttons(qapp: SparkApplication, icon_style: None) -> None:
    # Without the app's style sheet rule this style gives the standard buttons icons: the test below can fail.
    qapp.setStyleSheet("")
    box = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
    assert all(not b.icon().isNull() for b in box.findChildren(QPushButton))
    theme.apply(qapp, qapp.scheme)


def test_no_dialog_button_has_an_icon(qapp: SparkApplication, icon_style: None) -> None:
    d = Dialogs(None)
    asks: dict[str, Callable[[], Any]] = {
        "confirm": lambda: d.confirm("Delete", "Delete this conversation?", "Delete"),
        "ask_text": lambda: d.ask_text("Rename", "Title:", "A conversation"),
        "about": d.about,
        "help": lambda: d.help([("New Chat", "Ctrl+N")]),
        "add_server": d.add_server,
        "settings": lambda: d.edit_settings(GenerationSettings(), True),
        "conversation sampling": lambda: d.edit_conversation_sampling(None, SamplingChoice(), None),
        "tool consent": lambda: d.ask_tool_consent(PendingCall("files", "read", {"path": "a.txt"})),
        "schema": lambda: d.edit_schema('{"type": "object"}'),
        "a message box": lambda: QMessageBox.question(None, "Quit?", "Quit now?"),
    }
    for name, ask in asks.items():
        buttons = shown_buttons(ask)
        assert buttons, f"{name}: no dialog buttons were found"
        assert not [text for text, icon in buttons if icon], f"{name}: buttons with icons"
