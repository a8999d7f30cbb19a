"""HTTP clients a test opens, closed when the test ends: an unclosed client's socket is a ResourceWarning, which the
strict warning filter turns into a failure of whichever later test the garbage collector happens to run in."""

from __future__ import annotations

from typing import Protocol, TypeVar


class Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)
_open: list[Closable] = []


def closed_after_test(client: C) -> C:
    _open.append(client)
    return client


def close_all() -> None:
    while _open:
        _open.pop().close()
