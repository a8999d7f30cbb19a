"""The look's colours are readable: every text-on-surface pair the style sheet and the chat draw has WCAG contrast
of at least 4.5:1, light and dark; the sheet names only colours a scheme defines; the interface's icons draw."""

from __future__ import annotations

import re
from dataclasses import asdict

import pytest

from app.misc import theme
from app.misc.ui_icons import icon
from engine.paths import resources_dir


@pytest.mark.parametrize("colours", [theme.LIGHT, theme.DARK], ids=["light", "dark"])
def test_every_text_pair_has_contrast_of_at_least_4_5(colours: theme.Colours) -> None:
    values = asdict(colours)
    low = [
        (fg, bg, round(theme.contrast(values[fg], values[bg]), 2))
        for fg, bg in theme.CONTRAST_PAIRS
        if theme.contrast(values[fg], values[bg]) < 4.5
    ]
    assert low == []


def test_the_contrast_formula_matches_wcag() -> None:
    assert theme.contrast("#000000", "#ffffff") == pytest.approx(21.0)
    assert theme.contrast("#767676", "#ffffff") == pytest.approx(4.54, abs=0.01)  # the usual grey at the limit


def test_the_sheet_names_only_the_schemes_colours() -> None:
    sheet = (resources_dir() / theme.STYLE_SHEET).read_text(encoding="utf-8")
    named = set(re.findall(r"@(\w+)@", sheet))
    assert named and named <= set(asdict(theme.LIGHT))
    assert "@" not in theme.style_sheet(theme.DARK)


def test_interface_icons_draw(qtbot) -> None:  # type: ignore[no-untyped-def]
    for name in (
        "sidebar",
        "new-chat",
        "regenerate",
        "stop",
        "send",
        "inspector",
        "settings",
        "copy",
        "branch",
        "check",
    ):
        image = icon(name).pixmap(24, 24).toImage()
        assert any(image.pixelColor(x, y).alpha() for x in range(24) for y in range(24)), name
