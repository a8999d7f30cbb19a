"""One running app per user and data folder: a second launch (a file opened from the file manager, `python -m app
chat.spark`) hands its files to the running one over a local socket and exits.

The socket lives in the user's own cache folder (Qt makes it readable by its user only), so its name is per user and
per data folder. The running app's side (`InstanceServer`) treats every peer as possibly hostile: a message is one
line of at most MAX_MESSAGE bytes, read within READ_TIMEOUT_MS; anything else (junk, no newline, too long, too
slow, not the JSON below) is dropped with one log line and the connection closed. The message:

    {"spark": 1, "open": ["/absolute/path.spark", ...]}\n      answered "ok\n" or "refused\n"

A launch finding a socket file nobody answers (the app that made it crashed) removes it and becomes the running app.
The launching side speaks through plain sockets (`hand_over`), so it needs no QApplication and starts nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import sys
import tempfile
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal, Slot
from PySide6.QtNetwork import QLocalServer, QLocalSocket

log = logging.getLogger(__name__)

PROTOCOL = 1
MAX_MESSAGE = 64 << 10  # bytes of one request: far more than any list of paths a launch sends
MAX_PATHS = 64
MAX_PATH_CHARS = 4096
READ_TIMEOUT_MS = 2000  # a peer has this long to send its line
HAND_OVER_TIMEOUT_S = 3.0  # a launch waits this long for the running app's answer
SOCKET_PATH_MAX = 100  # sockaddr_un's path is 104 bytes on macOS, 108 on Linux


def socket_path(cache: Path) -> Path:
    """The socket of the app that uses `cache` (a short path in the temporary folder where `cache` is too deep)."""
    path = cache / "spark.sock"
    if len(str(path).encode()) <= SOCKET_PATH_MAX:
        return path
    digest = hashlib.sha256(str(cache).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"spark-{digest}.sock"


def request_bytes(paths: list[Path]) -> bytes:
    return json.dumps({"spark": PROTOCOL, "open": [str(p) for p in paths]}).encode() + b"\n"


def parse_request(raw: bytes) -> list[Path] | None:
    """The paths a request asks to open; None for anything that is not a request (then nothing is opened)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("spark") != PROTOCOL or set(data) != {"spark", "open"}:
        return None
    items = data["open"]
    if not isinstance(items, list) or len(items) > MAX_PATHS:
        return None
    if not all(isinstance(p, str) and 0 < len(p) <= MAX_PATH_CHARS and "\0" not in p for p in items):
        return None
    paths = [Path(p) for p in items]
    return paths if all(p.is_absolute() for p in paths) else None


def hand_over(path: Path, files: list[Path], timeout_s: float = HAND_OVER_TIMEOUT_S) -> bool:
    """Give `files` (absolute) to the app listening at `path`; True when it took them (this launch may exit)."""
    if sys.platform == "win32" or not path.exists():
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(path))
            s.sendall(request_bytes(files))
            answer = b""
            while not answer.endswith(b"\n") and len(answer) < 64:
                chunk = s.recv(64)
                if not chunk:
                    break
                answer += chunk
    except OSError:  # nobody listens (a stale socket), or it did not answer in time
        return False
    return answer == b"ok\n"


class InstanceServer(QObject):
    """The running app's end: `files_requested(list[Path])` for each well-formed request (an empty list: a second
    launch without files, which should bring the window forward)."""

    files_requested = Signal(list)

    def __init__(self, path: Path, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.path = path
        self._server = QLocalServer(self)
        self._server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        self._server.newConnection.connect(self._on_connection)
        self._buffers: dict[QLocalSocket, bytearray] = {}

    def listen(self) -> bool:
        """Start listening; a socket file left by an app that is gone is removed first. False (logged) when
        another app answers there or the socket cannot be made."""
        if hand_over_probe(self.path):
            log.warning("another MLoT Spark already listens at %s", self.path)
            return False
        QLocalServer.removeServer(str(self.path))  # stale: its app is gone
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self._server.listen(str(self.path)):
            log.warning("could not listen for other launches at %s: %s", self.path, self._server.errorString())
            return False
        return True

    def close(self) -> None:
        self._server.close()

    @Slot()
    def _on_connection(self) -> None:
        while self._server.hasPendingConnections():
            peer = self._server.nextPendingConnection()
            self._buffers[peer] = bytearray()
            peer.readyRead.connect(lambda p=peer: self._on_ready(p))
            peer.disconnected.connect(lambda p=peer: self._drop(p))
            QTimer.singleShot(READ_TIMEOUT_MS, peer, lambda p=peer: self._refuse(p, "it sent no request in time"))

    def _on_ready(self, peer: QLocalSocket) -> None:
        buffer = self._buffers.get(peer)
        if buffer is None:
            return
        buffer += bytes(peer.read(MAX_MESSAGE + 1 - len(buffer)).data())
        line, newline, _rest = bytes(buffer).partition(b"\n")
        if not newline:
            if len(buffer) > MAX_MESSAGE:
                self._refuse(peer, "its request is too long")
            return
        paths = parse_request(line)
        if paths is None:
            self._refuse(peer, "its request is not one")
            return
        peer.write(b"ok\n")
        peer.flush()
        self._finish(peer)
        self.files_requested.emit(paths)

    def _refuse(self, peer: QLocalSocket, why: str) -> None:
        if peer not in self._buffers:
            return  # answered already
        log.warning("a local connection was closed: %s", why)
        peer.write(b"refused\n")
        peer.flush()
        self._finish(peer)

    def _finish(self, peer: QLocalSocket) -> None:
        self._buffers.pop(peer, None)
        peer.disconnectFromServer()
        peer.deleteLater()

    def _drop(self, peer: QLocalSocket) -> None:
        if self._buffers.pop(peer, None) is not None:
            peer.deleteLater()


def hand_over_probe(path: Path) -> bool:
    """Whether an app answers at `path` (a connection is made and closed; nothing is sent)."""
    if sys.platform == "win32" or not path.exists():
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(str(path))
    except OSError:
        return False
    return True
