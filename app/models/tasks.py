"""The model library's slow work (Hub search, file lists, downloads, deletes) off the GUI thread.

Each request runs on a Python thread of its own and reports through this object's signals, which Qt queues to the
GUI thread (the object lives there). A download is paused or cancelled through its `DownloadControl`, which the
download checks between 1 MiB chunks, so the GUI never waits on it; at most one download runs at a time.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

from PySide6.QtCore import QObject, Signal

from engine import SparkError
from engine.library.download import DownloadControl, DownloadProgress, DownloadStopped
from engine.library.hub import LibraryError, Problem, RepoFiles
from engine.library.library import Library
from engine.library.store import LocalModel

REACH_TIMEOUT_S = 5.0
# The Hub client's retry warnings: a failure is told once, in the dialog, in one sentence.
logging.getLogger("huggingface_hub.utils._http").setLevel(logging.ERROR)


class LibraryTasks(QObject):
    search_done = Signal(str, list)  # query, list[HubRepo]
    files_ready = Signal(object)  # RepoFiles
    progress = Signal(object)  # DownloadProgress
    downloaded = Signal(object)  # LocalModel
    stopped = Signal(str, str, str)  # repo, file, "paused" | "cancelled"
    removed = Signal(str)  # model name
    failed = Signal(str, str)  # what was being done ("search", "files", "download", "remove"), one sentence

    def __init__(self, library: Library, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.library = library
        self._control: DownloadControl | None = None
        self._threads: list[threading.Thread] = []

    @property
    def downloading(self) -> bool:
        return self._control is not None

    def search(self, query: str) -> None:
        def run() -> None:
            self._reachable()
            self.search_done.emit(query, self.library.hub.search(query))

        self._start("search", run)

    def list_files(self, repo: str) -> None:
        def run() -> None:
            self._reachable()
            files: RepoFiles = self.library.hub.repo_files(repo)
            self.files_ready.emit(files)

        self._start("files", run)

    def download(self, repo: str, file: str | None) -> bool:
        """Start a download; False (and nothing started) while another one runs."""
        if self._control is not None:
            return False
        control = self._control = DownloadControl()

        def report(p: DownloadProgress) -> None:
            self.progress.emit(p)

        def run() -> None:
            outcome: LocalModel | DownloadStopped
            try:
                outcome = self.library.downloader().download(repo, file, progress=report, control=control)
            except DownloadStopped as stop:
                outcome = stop
            finally:
                # Cleared before the outcome is told: a Resume clicked on hearing "paused" must start a new download,
                # not pause this finished one.
                self._control = None
            if isinstance(outcome, DownloadStopped):
                self.stopped.emit(repo, file or "", outcome.reason.value)
            else:
                self.downloaded.emit(outcome)

        self._start("download", run)
        return True

    def pause(self) -> None:
        if self._control is not None:
            self._control.pause()

    def cancel(self) -> None:
        if self._control is not None:
            self._control.cancel()

    def discard(self, repo: str, file: str | None) -> None:
        """Cancel a paused download: its partial file goes (told as "cancelled", as a running one's cancel is)."""

        def run() -> None:
            store = self.library.store
            for partial in store.partials():
                if partial.source.repo == repo and (file is None or partial.source.file == file):
                    store.discard_partial(partial.source)
            self.stopped.emit(repo, file or "", "cancelled")

        self._start("download", run)

    def remove(self, name: str) -> None:
        self._start("remove", lambda: self.removed.emit(self.library.store.remove(name).name))

    def wait(self, timeout_s: float = 30.0) -> None:
        """Stop a running download (kept to resume) and wait for every thread: before the app quits."""
        self.pause()
        for t in self._threads:
            t.join(timeout_s)

    def _reachable(self) -> None:
        """Offline, say so at once: one connection attempt to the Hub's host, not the Hub client's retries (about
        23 s of them, each a warning on the terminal)."""
        endpoint = self.library.hub.settings.endpoint
        url = urlsplit(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname or "", port), timeout=REACH_TIMEOUT_S).close()
        except (OSError, ValueError):
            raise LibraryError(
                Problem.NO_NETWORK,
                f"Cannot reach the Hugging Face Hub at {endpoint}: check the network connection (and HF_ENDPOINT if "
                "you set it), then try again.",
            ) from None

    def _start(self, what: str, body: Callable[[], None]) -> None:
        def run() -> None:
            try:
                body()
            except SparkError as exc:
                self.failed.emit(what, str(exc))
            except OSError as exc:  # the models folder itself: unreadable, unwritable
                self.failed.emit(what, f"The models folder cannot be used ({exc.strerror or exc}).")

        thread = threading.Thread(target=run, name=f"models-{what}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
