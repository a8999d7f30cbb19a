"""A scripted Stop for the tests of a forward stopped midway (engine and Core ML alike)."""

from __future__ import annotations


class StopAt:
    """A `should_stop` that turns true at its `n`-th poll (and stays true)."""

    def __init__(self, n: int) -> None:
        self.n, self.polls = n, 0

    def __call__(self) -> bool:
        self.polls += 1
        return self.polls >= self.n
