"""A `PartTimer` (engine.backends.base) that counts a backend's native decoding steps."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext


class NativeStepCounter:
    def __init__(self) -> None:
        self.native_steps = 0
        self.parts: list[str] = []

    def open_part(self, name: str) -> None:
        self.parts.append(name)

    def close_part(self) -> None:
        pass

    def native_step(self) -> AbstractContextManager[object]:
        self.native_steps += 1
        return nullcontext()
