"""A file system whose writes wait for the test: a kept copy stays in flight as long as the test likes."""

from __future__ import annotations

import threading

from engine.fileio import FileSystem


class HeldWrites(FileSystem):
    """Writes that wait for `release` (set by the test): a kept copy stays in flight as long as the test likes."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def write(self, fd: int, data: memoryview) -> int:
        self.started.set()
        assert self.release.wait(60)
        return super().write(fd, data)
