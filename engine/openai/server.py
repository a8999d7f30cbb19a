"""Running the ASGI app with uvicorn: in the foreground (the CLI) or on a background thread (the app's "Local
Server" switch, tests, the bench), bound to 127.0.0.1 unless told otherwise. Port 0 picks a free port."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from engine.errors import SparkError
from engine.openai.asgi import create_app
from engine.openai.pool import ModelPool
from engine.openai.service import ModelService

LOOPBACK = "127.0.0.1"


class ServerError(SparkError):
    """The server could not start (e.g. its port is taken)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), or one sentence saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServerError(
            f"Cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host."
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


@dataclass
class LocalServer:
    """The server for `service` on host:port. `start()` runs it on a thread; `stop()` ends it and the scheduler."""

    service: ModelService | ModelPool  # one loaded model, or every servable model by name
    host: str = LOOPBACK
    port: int = 8080

    def __post_init__(self) -> None:
        self._sock = bind(self.host, self.port)
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(self.service), log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def serve_forever(self) -> None:
        """Run in this thread until Ctrl-C (uvicorn's own signal handling)."""
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self.service.close()
            self._sock.close()

    def start(self, timeout: float = 30.0) -> LocalServer:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="spark-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._server.started:
            self.stop()
            raise ServerError(f"The server on {self.host}:{self.port} did not start.")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.service.close()
        self._sock.close()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
