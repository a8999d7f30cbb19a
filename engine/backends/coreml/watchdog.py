"""A bound on calls into Core ML that may never return.

Core ML has been seen to deadlock the Neural Engine's daemon (`CPU_AND_NE` on macOS 26.3): a load or a prediction
then blocks its thread forever, and no Python code can interrupt it. So every such call runs on a daemon thread of
its own, and the caller waits for it at most a bound; past the bound the call is abandoned (its thread left blocked
where it is, never joined), the runtime is marked hung, and every later call refuses at once with the same sentence.
The caller (the backend registry) falls back to the next backend and remembers the reason for that model.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.errors import BackendUnavailable

T = TypeVar("T")
LOAD_BOUND_S = 600.0  # compiling a large model for the Neural Engine takes minutes, not hours
PREDICT_BOUND_S = 120.0  # a prefill chunk of a large model takes seconds


class RuntimeHung(BackendUnavailable):
    """Core ML did not return within its bound; the runtime was abandoned."""


@dataclass
class Health:
    """Shared by a backend and its forks: once one call hangs, the runtime is abandoned for all of them."""

    hung: str | None = None  # the sentence that says why, once a call has hung
    on_hang: Callable[[str], None] = field(default=lambda reason: None)  # e.g. remember the reason for the model


class Watchdog:
    """Runs calls one at a time on its own daemon thread and waits for each at most its bound."""

    def __init__(
        self, health: Health | None = None, load_s: float = LOAD_BOUND_S, predict_s: float = PREDICT_BOUND_S
    ) -> None:
        self.health = health or Health()
        self.load_s, self.predict_s = load_s, predict_s
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], list[tuple[bool, Any]], threading.Event]] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._serve, name="coreml-calls", daemon=True).start()

    def fork(self) -> Watchdog:
        """A watchdog with its own thread (a fork predicts beside its parent) sharing this one's health."""
        return Watchdog(self.health, self.load_s, self.predict_s)

    def _serve(self) -> None:
        while True:
            fn, box, done = self._calls.get()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the caller, who re-raises it on its own thread
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[[], T], bound_s: float, what: str) -> T:
        """fn() on the watchdog's thread; RuntimeHung (one sentence) when it has not returned after `bound_s`."""
        if self.health.hung is not None:
            raise RuntimeHung(self.health.hung)
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._calls.put((fn, box, done))
        if not done.wait(bound_s):
            reason = f"Core ML did not finish {what} within {bound_s:g} s, so it was abandoned for this model."
            self.health.hung = reason
            self.health.on_hang(reason)
            raise RuntimeHung(reason)
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def load(self, fn: Callable[[], T]) -> T:
        return self.call(fn, self.load_s, "loading the model")

    def predict(self, fn: Callable[[], T]) -> T:
        return self.call(fn, self.predict_s, "a prediction")
