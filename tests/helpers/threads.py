"""Running a call on another thread, as the app's worker threads do."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_worker(fn: Callable[[], T]) -> T:
    """Run `fn` on another thread, as the conversation worker would (the GUI thread never calls the toolbox)."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(120)
    assert out, "the worker did not finish"
    return out[0]
