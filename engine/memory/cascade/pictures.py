"""Where a conversation's pictures lie among its tokens, so that the cascade keeps each picture a unit.

A picture enters the prompt as ordinary ids (engine.vision), and the cascade never imports the vision code: it is
given `PictureTokens`, which says of an id whether it is a picture's token, and which (its index in its picture and
the picture's token count; engine.vision.model.VisionModel.picture_token). A picture's span runs from its first
token (index 0) to its last (index count - 1), the text tokens a processor puts between its tiles included; a run
whose indices do not follow 0, 1, ..., count - 1 is no picture (nothing a hostile prompt places makes a span).

What the cascade does with the spans (engine.memory.cascade.core): the window's edge never falls inside one
(`cut`), a picture leaving the window leaves whole, and retrieval brings its blocks back together (`blocks`,
engine.memory.cascade.retrieval). The spans are part of the memory's state when there are any, so a restored memory
evicts and recalls exactly as an uninterrupted one; a state without them (written before any picture, or by a
memory that was given no `PictureTokens`) is scanned again from its tokens.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

# id -> (its index in its picture, the picture's token count), or None for a text token
PictureTokens = Callable[[int], tuple[int, int] | None]


class PictureSpans:
    """The spans [start, end) of the pictures fed so far, in conversation order, and the one being fed."""

    def __init__(self, tokens: PictureTokens | None = None) -> None:
        self.tokens = tokens
        self.reset()

    def reset(self) -> None:
        self.spans: list[tuple[int, int]] = []  # closed pictures, [start, end) of the conversation's tokens
        self.starts: list[int] = []  # their starts, for bisect
        self.open: tuple[int, int, int] | None = None  # a picture being fed: (start, next index, count)

    def feed(self, ids: Sequence[int], start: int) -> None:
        """`ids`, the conversation's tokens from index `start` on, were fed."""
        if self.tokens is None:
            return
        for i, token in enumerate(ids, start):
            got = self.tokens(token)
            if got is None:
                continue
            index, count = got
            if index == 0:  # a new picture; an unfinished one before it is no unit
                self.open = (i, 0, count)
            if self.open is None or self.open[1] != index or self.open[2] != count:
                self.open = None
                continue
            begin = self.open[0]
            self.open = (begin, index + 1, count)
            if index + 1 == count:
                self.spans.append((begin, i + 1))
                self.starts.append(begin)
                self.open = None

    def truncate(self, tokens: Sequence[int], n: int) -> None:
        """The conversation was taken back to its first `n` tokens (`tokens`: them and possibly more)."""
        again = [s for s, e in self.spans if s < n < e]
        if self.open is not None and self.open[0] < n:
            again.append(self.open[0])
        kept = [(s, e) for s, e in self.spans if e <= n]
        self.spans, self.starts, self.open = kept, [s for s, _ in kept], None
        if again:
            self.feed(tokens[again[0] : n], again[0])

    def cut(self, edge: int) -> tuple[int, int] | None:
        """The closed picture whose span the boundary before token `edge` would cut (start < edge < end), if any."""
        at = bisect.bisect_left(self.starts, edge) - 1
        if at >= 0 and self.spans[at][1] > edge:
            return self.spans[at]
        return None

    def ends_in(self, ids: Sequence[int], base: int) -> list[int]:
        """Indices of `ids` (the conversation's tokens from index `base` on) just past each picture they end,
        pictures begun before `base` included (a prompt's ids from its start hold those)."""
        probe = PictureSpans(self.tokens)
        probe.feed(ids, base)
        return [e - base for _, e in probe.spans]

    def blocks(self, sinks: int, block: int) -> list[range]:
        """Each closed picture's episodic block ids (block j holds tokens [sinks + j*block, sinks + (j+1)*block));
        a part among the sinks never leaves them."""
        out = []
        for s, e in self.spans:
            if e > sinks:
                out.append(range((max(s, sinks) - sinks) // block, -(-(e - sinks) // block)))
        return out

    # -- state --------------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any] | None:
        """None when there is nothing to say (a text conversation's state stays as it was)."""
        if not self.spans and self.open is None:
            return None
        return {"spans": [list(s) for s in self.spans], "open": None if self.open is None else list(self.open)}

    def load_state(self, meta: dict[str, Any] | None, tokens: Sequence[int]) -> None:
        """meta as state() wrote it (checked by engine.memory.cascade.state_schema), or None: scanned again."""
        self.reset()
        if meta is None:
            self.feed(tokens, 0)
            return
        self.spans = [(int(s), int(e)) for s, e in meta["spans"]]
        self.starts = [s for s, _ in self.spans]
        opened = meta["open"]
        self.open = None if opened is None else (int(opened[0]), int(opened[1]), int(opened[2]))
