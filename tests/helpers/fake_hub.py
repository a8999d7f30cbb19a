"""A loopback Hugging Face Hub for the model library's tests: the routes `huggingface_hub` calls, on 127.0.0.1.

- `GET /api/models?search=&filter=&limit=` — search (`HfApi.list_models`);
- `GET /api/models/{repo}[/revision/{rev}]?blobs=true` — model info with siblings, LFS sha256 and sizes, the GGUF
  summary (`HfApi.model_info(files_metadata=True)`);
- `HEAD|GET /{repo}/resolve/{rev}/{file}` — the file, with the headers `get_hf_file_metadata` reads (ETag,
  X-Linked-Etag, X-Repo-Commit, X-Linked-Size) and Range requests answered 206 (416 past the end).

Access as the Hub answers it: a private repo without the right token is 401 `RepoNotFound` (an invalid token: 401
"Invalid credentials"), a missing repo 401/404 `RepoNotFound`, a missing file 404 `EntryNotFound`, a gated repo's
file 401 `GatedRepo` (its info stays public). Faults the tests inject per file: `flip_byte_at` (serve a damaged
byte; the metadata keeps the true sha256), `advertised_sha256` (metadata that lies), `cut_after` (close the connection after that many body bytes),
`hold_after` (send that many bytes, then wait until `release()`), `drip_s` (one byte at a time, this long apart).
Every request is logged for the tests to assert.

A hostile Hub (`hub.hostile`, a `Hostile`): the API routes (search, model info) answer a raw body (HTML, a dict
where a list belongs, JSON nested thousands deep), stall after their headers or drip their body, answer 429 with any
Retry-After, send `Link: rel="next"` to any URL (another origin, or an endless chain), redirect in a loop; the info
lists extra sibling names (NUL, ANSI escapes, U+202E, 10,000 characters, `../`); a file redirects to another origin.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeFile:
    data: bytes
    flip_byte_at: int | None = None
    cut_after: int | None = None
    hold_after: int | None = None
    advertised_sha256: str | None = None  # what the metadata claims instead of the true sha256 (a hostile Hub)
    drip_s: float | None = None  # send the body one byte at a time, this long apart

    @property
    def sha256(self) -> str:
        return self.advertised_sha256 or hashlib.sha256(self.data).hexdigest()

    def served(self) -> bytes:
        if self.flip_byte_at is None:
            return self.data
        damaged = bytearray(self.data)
        damaged[self.flip_byte_at] ^= 0xFF
        return bytes(damaged)


@dataclass
class FakeRepo:
    files: dict[str, FakeFile]
    architecture: str | None = "llama"
    gated: bool = False
    token: str | None = None  # a private repo: only this bearer token may see it
    downloads: int = 100


@dataclass
class Hostile:
    """How the API routes (`/api/...`) misbehave; all off by default."""

    body: bytes | None = None  # answered instead of the real JSON
    status: int | None = None  # answered instead of 200 (with `retry_after` when set)
    retry_after: str | None = None
    stall_after_headers: bool = False  # headers, then nothing until `release()`
    drip_s: float | None = None  # the body a byte at a time
    link_next: str | None = None  # `Link: <...>; rel="next"` on every search page ("{n}" is the page's number)
    redirect_loop: bool = False  # every API request is 302 to itself
    siblings: list[str] = field(default_factory=list)  # extra file names in every model info (a GGUF each)
    file_redirect: str | None = None  # a file's GET is 302 to this URL (another origin)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None
    query: dict[str, list[str]] = field(default_factory=dict)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self.hostile = Hostile()
        self._released = threading.Event()
        self._server = _QuietServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def add(self, repo: str, files: dict[str, bytes], **kwargs: object) -> FakeRepo:
        fake = FakeRepo({name: FakeFile(data) for name, data in files.items()}, **kwargs)  # type: ignore[arg-type]
        self.repos[repo] = fake
        return fake

    def release(self) -> None:
        """Let held transfers (`hold_after`) finish."""
        self._released.set()

    def downloads_of(self, file: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith(f"/{file}") and "/resolve/" in r.path]

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._released.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A client that went away mid-transfer (a killed download) is what these tests do on purpose."""


@contextmanager
def running_hub() -> Iterator[FakeHub]:
    hub = FakeHub().start()
    try:
        yield hub
    finally:
        hub.stop()


_INFO_RE = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
_RESOLVE_RE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE_RE = re.compile(r"^bytes=(\d+)-$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet: the log is `hub.requests`
            return

        def do_GET(self) -> None:
            self._route("GET")

        def do_HEAD(self) -> None:
            self._route("HEAD")

        def _route(self, method: str) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            query = parse_qs(url.query)
            hub.requests.append(
                Request(method, path, self.headers.get("Range"), self.headers.get("Authorization"), query)
            )
            if path.startswith("/api/") and self._misbehave():
                return None
            if path == "/api/models" and method == "GET":
                return self._search(query)
            m = _INFO_RE.match(path)
            if m and method == "GET":
                return self._info(m.group(1))
            m = _RESOLVE_RE.match(path)
            if m:
                return self._resolve(method, m.group(1), m.group(3))
            self._error(404, "NotFound", "no such route")

        # -- answers ---------------------------------------------------------------------------------------------
        def _misbehave(self) -> bool:
            """Answer as the hostile Hub would, or return False for the real answer."""
            h = hub.hostile
            if h.redirect_loop:
                self.send_response(302)
                self.send_header("Location", self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True
            if h.status is not None:
                self.send_response(h.status)
                if h.retry_after is not None:
                    self.send_header("Retry-After", h.retry_after)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True
            if h.stall_after_headers:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.flush()
                hub._released.wait(timeout=120)
                return True
            if h.body is not None:
                self._send_body(h.body, "text/html")
                return True
            return False

        def _send_body(self, raw: bytes, kind: str = "application/json") -> None:
            h = hub.hostile
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(raw)))
            if h.link_next is not None:
                n = len([r for r in hub.requests if r.path == "/api/models"])
                self.send_header("Link", f'<{h.link_next.replace("{n}", str(n))}>; rel="next"')
            self.end_headers()
            if h.drip_s is None:
                self.wfile.write(raw)
                return
            for i in range(len(raw)):
                if hub._released.is_set():
                    return
                self.wfile.write(raw[i : i + 1])
                self.wfile.flush()
                hub._released.wait(h.drip_s)

        def _json(self, body: object, status: int = 200) -> None:
            self._send_body(json.dumps(body).encode())

        def _error(self, status: int, code: str | None, message: str) -> None:
            raw = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(raw)

        def _visible(self, repo_id: str) -> FakeRepo | None:
            """The repo, or None after answering as the Hub does for a missing, private or wrongly-tokened one."""
            repo = hub.repos.get(repo_id)
            auth = self.headers.get("Authorization")
            if repo is not None and repo.token is not None and auth != f"Bearer {repo.token}":
                if auth is not None:
                    self._error(401, None, "Invalid credentials in Authorization header")
                else:
                    self._error(401, "RepoNotFound", "Repository not found")
                return None
            if repo is None:
                self._error(404 if auth else 401, "RepoNotFound", "Repository not found")
                return None
            return repo

        def _search(self, query: dict[str, list[str]]) -> None:
            text = query.get("search", [""])[0].lower()
            limit = int(query.get("limit", ["1000"])[0])
            found = [
                {"id": rid, "modelId": rid, "downloads": r.downloads, "likes": 1, "gated": r.gated, "tags": ["gguf"]}
                for rid, r in sorted(hub.repos.items(), key=lambda kv: -kv[1].downloads)
                if text in rid.lower() and r.token is None
            ]
            self._json(found[:limit])

        def _info(self, repo_id: str) -> None:
            repo = self._visible(repo_id)
            if repo is None:
                return
            siblings = [
                {
                    "rfilename": name,
                    "size": len(f.data),
                    "blobId": hashlib.sha1(f.data).hexdigest(),
                    "lfs": {"sha256": f.sha256, "size": len(f.data), "pointerSize": 134},
                }
                for name, f in repo.files.items()
            ] + [
                {"rfilename": name, "size": 4, "lfs": {"sha256": "0" * 64, "size": 4}} for name in hub.hostile.siblings
            ]
            body: dict[str, object] = {
                "_id": repo_id,
                "id": repo_id,
                "modelId": repo_id,
                "sha": COMMIT,
                "private": repo.token is not None,
                "gated": "auto" if repo.gated else False,
                "downloads": repo.downloads,
                "likes": 1,
                "tags": ["gguf"],
                "siblings": siblings,
            }
            if repo.architecture:
                body["gguf"] = {"architecture": repo.architecture, "total": 1, "context_length": 4096}
            self._json(body)

        def _resolve(self, method: str, repo_id: str, name: str) -> None:
            repo = self._visible(repo_id)
            if repo is None:
                return
            if repo.gated and self.headers.get("Authorization") is None:
                return self._error(401, "GatedRepo", "Access to this model is restricted")
            if hub.hostile.file_redirect is not None:
                self.send_response(302)
                self.send_header("Location", hub.hostile.file_redirect)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            f = repo.files.get(name)
            if f is None:
                return self._error(404, "EntryNotFound", "Entry not found")
            data = f.served()
            start = 0
            m = _RANGE_RE.match(self.headers.get("Range") or "")
            if m:
                start = int(m.group(1))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            self.send_response(206 if m else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{f.sha256}"')
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(len(f.data)))
            self.send_header("X-Repo-Commit", COMMIT)
            if m:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if method == "HEAD":
                return
            body = data[start:]
            if f.hold_after is not None and not hub._released.is_set():
                self.wfile.write(body[: f.hold_after])
                self.wfile.flush()
                hub._released.wait(timeout=120)
                body = body[f.hold_after :]
            if f.cut_after is not None:
                self.wfile.write(body[: f.cut_after])
                self.wfile.flush()
                self.close_connection = True
                return
            if f.drip_s is not None:
                for i in range(len(body)):
                    if hub._released.is_set():
                        return
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()
                    hub._released.wait(f.drip_s)
                return
            self.wfile.write(body)

    return Handler
