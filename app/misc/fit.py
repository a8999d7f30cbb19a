"""Dialogs tall enough for their wrapped text: Qt's form layouts size a word-wrapped label for one line, so at a
dialog's default size its later lines are cut off. Called when the dialog is shown, once its width is known."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QWidget


def fit_wrapped_text(window: QWidget) -> None:
    """Each visible wrapped label of `window` at least as tall as its text at its width; the window grown to hold them."""
    layout = window.layout()
    if layout is not None:
        layout.activate()
    grew = False
    for label in window.findChildren(QLabel):
        if label.wordWrap() and label.isVisibleTo(window) and label.width() > 0:
            need = label.heightForWidth(label.width())
            if need > label.height():
                label.setMinimumHeight(need)
                grew = True
    if grew:
        if layout is not None:
            layout.activate()
        window.resize(
            window.width(), max(window.height(), window.sizeHint().height(), window.minimumSizeHint().height())
        )
