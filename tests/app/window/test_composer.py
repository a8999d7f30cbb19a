"""The composer grows with its text up to the height it is given and counts the prompt's tokens against the
context as the user types (after a short pause)."""

from __future__ import annotations

from app.window.composer import Composer


def test_grows_to_its_limit_and_counts_tokens(qtbot) -> None:  # type: ignore[no-untyped-def]
    composer = Composer()
    qtbot.addWidget(composer)
    composer.resize(600, 300)
    composer.show()
    composer.set_max_height(240)
    small = composer.prompt.height()
    composer.set_counter(lambda text: len(text.split()), 100)
    composer.prompt.setPlainText("\n".join(f"line {i}" for i in range(6)))
    assert composer.prompt.height() > small  # six lines: taller than three
    composer.prompt.setPlainText("word " * 20000 + "\n" * 400)
    assert composer.prompt.height() == 240  # no taller than it is allowed (a third of the window)
    qtbot.waitUntil(lambda: composer.token_count_text().startswith("20,000 tokens"), timeout=2000)
    assert "100-token context" in composer.token_count_text() and composer.count.property("over") is True
    composer.prompt.setPlainText("two words")
    qtbot.waitUntil(lambda: composer.token_count_text().startswith("2 tokens"), timeout=2000)
    assert composer.count.property("over") is False
    composer.set_counter(None, 0)  # a remote model: no count
    assert composer.token_count_text() == ""
