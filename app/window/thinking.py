"""A reasoning model's thinking in the chat: a folded "Thought for N s" line above the answer (open to read it; while
the model thinks, "Thinking… N s" and the thought so far), one per reply. The chat view asks this for the block's
lines as it renders a reply; the answer's Copy copies the answer only (the thinking is not part of it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtGui import QTextBlockFormat, QTextCharFormat, QTextCursor

LinkFormat = Callable[[str, str], QTextCharFormat]  # (href, tooltip) -> the format of a link
PREVIEW_CHARS = 400  # while folded and still thinking: the last of the thought, so the wait shows progress


class Thoughts:
    """Each reply's thinking by message index: its text, how long it took, and whether it is open."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.texts: dict[int, str] = {}
        self.seconds: dict[int, float] = {}  # thinking that has ended: how long it took
        self.opened: set[int] = set()
        self._started: dict[int, float] = {}  # thinking going on: since when

    def add(self, index: int, text: str) -> None:
        if index not in self.texts:
            self._started[index] = self.clock()
        self.texts[index] = self.texts.get(index, "") + text

    def stop(self, index: object) -> None:
        """The answer began (or the reply ended): the thinking took until now."""
        if isinstance(index, int) and index in self._started:
            self.seconds[index] = self.clock() - self._started.pop(index)

    def thinking(self, index: int) -> bool:
        return index in self._started

    def renumber(self, old: object, new: int) -> None:
        """The reply's index changed when it ended (a turn with tool calls holds several messages)."""
        if not isinstance(old, int) or old == new or old not in self.texts:
            return
        self.texts[new] = self.texts.pop(old)
        for times in (self.seconds, self._started):
            if old in times:
                times[new] = times.pop(old)
        if old in self.opened:
            self.opened.discard(old)
            self.opened.add(new)

    def forget(self, index: int) -> None:
        self.texts.pop(index, None)
        self.seconds.pop(index, None)
        self._started.pop(index, None)
        self.opened.discard(index)

    def toggle(self, index: int) -> None:
        self.opened ^= {index}

    def header(self, index: int) -> str:
        if self.thinking(index):
            return f"Thinking… {self.clock() - self._started[index]:.0f} s"
        arrow = "▾" if index in self.opened else "▸"
        return f"{arrow} Thought for {max(1, round(self.seconds.get(index, 0.0)))} s"

    def insert(self, cursor: QTextCursor, index: int, link: LinkFormat, note: QTextCharFormat) -> None:
        """Write reply `index`'s thinking block at `cursor` (nothing for a reply without thinking)."""
        text = self.texts.get(index, "").strip()
        if not text and not self.thinking(index):
            return
        tip = "Fold the thinking" if index in self.opened else "Read what the model thought before answering"
        cursor.insertText(self.header(index), link(f"think:{index}", tip))
        if index in self.opened or self.thinking(index):
            shown = text if index in self.opened else text[-PREVIEW_CHARS:]
            block = QTextBlockFormat()
            block.setLeftMargin(12)
            cursor.insertBlock(block, note)
            cursor.insertText(shown, note)
        cursor.insertBlock(QTextBlockFormat())
