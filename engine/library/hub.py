"""The Hugging Face Hub over plain HTTP: search GGUF repos, list a repo's GGUF files with their sizes and sha256, and
open a file's byte stream from an offset (the downloader resumes with it).

`HF_ENDPOINT` (a mirror, a company proxy, or the tests' loopback Hub), `HF_TOKEN` (or the token `hf auth login`
stored) and `HF_HUB_OFFLINE` are read when a client is made, not when the module is imported.

Every reply is hostile input (a mirror may be anyone's):
- the token goes only to the configured endpoint's origin: redirects are followed by hand (at most
  `max_redirects`) and a search's `Link: next` page on another origin is not asked for at all;
- every call has one deadline for all its requests, pages and redirects together; JSON replies are bounded in size
  and nesting before they are parsed; nothing is retried by itself (a 429 or 503 is reported with its
  Retry-After when that is a sane figure, never waited out);
- repo ids and file names are checked (`check_repo_id`, `check_file_name`) before they go into a URL, a path or a
  message, and printed through `engine.untrusted.shown`;
- a connection that cannot be made marks the Hub unreachable for `offline_hold_s`, so the calls after it fail at
  once instead of each waiting out its own connect timeout (no retry storm).

Every failure becomes a `LibraryError`: one sentence saying what to do, and a `Problem` the app can act on.
"""

from __future__ import annotations

import enum
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import quote, urljoin, urlsplit

import httpx2
from huggingface_hub import constants as hf_constants
from huggingface_hub import get_token

from engine.errors import SparkError
from engine.library.names import file_name_problem, repo_id_problem
from engine.untrusted import loads_bounded, shown
from engine.version import __version__

DEFAULT_ENDPOINT = "https://huggingface.co"
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)  # one part of a split GGUF
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_REVISION_RE = re.compile(r"[0-9a-f]{40}")
_REDIRECTS = {301, 302, 303, 307, 308}


class Problem(enum.Enum):
    OFFLINE = "offline"
    NO_NETWORK = "no_network"
    GATED = "gated"
    NOT_FOUND = "not_found"  # no such repo, or a private one this token cannot see
    NO_FILE = "no_file"
    FORBIDDEN = "forbidden"
    HUB_ERROR = "hub_error"
    DISK_FULL = "disk_full"
    BAD_HASH = "bad_hash"
    BAD_FILE = "bad_file"
    UNSUPPORTED = "unsupported"
    CHOOSE_FILE = "choose_file"


class LibraryError(SparkError):
    """A search or download that could not go on; `str()` is one sentence saying what to do."""

    def __init__(self, problem: Problem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


@dataclass(frozen=True)
class HubLimits:
    """How long and how much one Hub call may take. The tests shrink these; the defaults suit a slow link."""

    deadline_s: float = 30.0  # one whole call: every request, page and redirect of a search or a model info
    connect_s: float = 10.0
    read_s: float = 2.0  # a file's transfer waits this long for its next bytes (then the downloader checks pause,
    # cancel and its stall rule, and asks again); an API call's reads have what is left of its deadline
    max_json_bytes: int = 32 << 20  # a repo with thousands of files is a few MB
    max_json_depth: int = 32  # the Hub's replies nest about 5 deep
    max_redirects: int = 5
    max_pages: int = 10
    offline_hold_s: float = 10.0  # after a failed connection, calls fail at once for this long


@dataclass(frozen=True)
class HubSettings:
    endpoint: str
    token: str | None  # None: huggingface_hub's own (HF_TOKEN, or the stored login)
    offline: bool

    @classmethod
    def from_env(cls) -> HubSettings:
        offline = hf_constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes"}
        endpoint = (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        return cls(endpoint=endpoint, token=os.environ.get("HF_TOKEN") or None, offline=offline)


@dataclass(frozen=True)
class HubRepo:
    id: str
    downloads: int
    likes: int
    gated: bool


@dataclass(frozen=True)
class HubFile:
    name: str
    size_bytes: int
    sha256: str | None  # the LFS sha256 (None for a file not stored in LFS: it cannot be verified)


@dataclass(frozen=True)
class RepoFiles:
    repo: str
    revision: str  # the commit these files are at
    gated: bool
    architecture: str | None  # the Hub's reading of the GGUF header, where it gives one
    files: tuple[HubFile, ...]
    projectors: tuple[HubFile, ...] = ()  # llama.cpp's vision projectors (mmproj*.gguf) beside the models

    def projector(self, name: str) -> HubFile | None:
        return next((f for f in self.projectors if f.name == name), None)

    def file(self, name: str) -> HubFile | None:
        return next((f for f in self.files if f.name == name), None)


# -- names ---------------------------------------------------------------------------------------------------------


def check_repo_id(repo: str) -> None:
    problem = repo_id_problem(repo)
    if problem is not None:
        raise LibraryError(
            Problem.NOT_FOUND, f"{shown(repo)!r} {problem}, so it is not a Hub repo id; write it as owner/name."
        )


def check_file_name(name: str) -> None:
    problem = file_name_problem(name)
    if problem is not None:
        raise LibraryError(
            Problem.BAD_FILE, f"The file name {shown(name)!r} {problem}, so MLoT Spark will not download it."
        )


def same_origin(url: str, endpoint: str) -> bool:
    a, b = urlsplit(url), urlsplit(endpoint)
    return (a.scheme.lower(), a.hostname, _port(a)) == (b.scheme.lower(), b.hostname, _port(b))


def _port(parts: Any) -> int | None:
    try:
        port: int | None = parts.port
    except ValueError:
        return -1
    if port is None:
        return {"http": 80, "https": 443}.get(parts.scheme.lower())
    return port


# -- the client ----------------------------------------------------------------------------------------------------


class HubClient:
    def __init__(self, settings: HubSettings | None = None, limits: HubLimits | None = None) -> None:
        self.settings = settings or HubSettings.from_env()
        self.limits = limits or HubLimits()
        token = self.settings.token
        if token is None and not self.settings.offline:
            token = get_token()  # the stored `hf auth login`
        self._token = token
        self._unreachable_until = 0.0
        self._lock = threading.Lock()

    def repo_page(self, repo: str) -> str:
        return f"{self.settings.endpoint}/{repo}"

    def search(self, query: str, limit: int = 20) -> list[HubRepo]:
        """GGUF model repos matching `query`, most downloaded first (at most `limit`, `max_pages` pages)."""
        deadline = time.monotonic() + self.limits.deadline_s
        params = {"search": query, "filter": "gguf", "sort": "downloads", "direction": "-1", "limit": str(limit)}
        url: str | None = f"{self.settings.endpoint}/api/models"
        found: list[HubRepo] = []
        with self._errors(None), _client() as http:
            for _ in range(self.limits.max_pages):
                if url is None or len(found) >= limit:
                    break
                body, links = self._get_json(http, url, params, deadline, None, what="the search")
                params = {}  # a next page's URL carries its own query
                if not isinstance(body, list):
                    raise _bad_reply("the search")
                for m in body:
                    repo = _repo_entry(m)
                    if repo is not None:
                        found.append(repo)
                url = links.get("next")
                if url is not None and not same_origin(url, self.settings.endpoint):
                    url = None  # another origin's page is not asked for: it would see the token
        return found[:limit]

    def repo_files(self, repo: str) -> RepoFiles:
        """The repo's single-file GGUF models (split parts and unsafe names left out) and, apart, its vision
        projectors, each with size and sha256."""
        check_repo_id(repo)
        deadline = time.monotonic() + self.limits.deadline_s
        with self._errors(repo), _client() as http:
            info, _ = self._get_json(
                http,
                f"{self.settings.endpoint}/api/models/{repo}",
                {"blobs": "true"},
                deadline,
                repo,
                what=f"{repo}'s file list",
            )
        if not isinstance(info, dict):
            raise _bad_reply(f"{repo}'s file list")
        siblings = info.get("siblings")
        files: list[HubFile] = []
        projectors: list[HubFile] = []
        for s in siblings if isinstance(siblings, list) else []:
            f = _file_entry(s)
            if f is not None:
                (projectors if _is_projector(f.name) else files).append(f)
        gguf = info.get("gguf")
        arch = gguf.get("architecture") if isinstance(gguf, dict) else None
        sha = info.get("sha")
        return RepoFiles(
            repo=repo,
            revision=sha if isinstance(sha, str) and _REVISION_RE.fullmatch(sha) else "main",
            gated=bool(info.get("gated")),
            architecture=arch if isinstance(arch, str) and len(arch) <= 64 and arch.isprintable() else None,
            files=tuple(files),
            projectors=tuple(projectors),
        )

    @contextmanager
    def open_stream(self, repo: str, file: str, revision: str, offset: int) -> Iterator[ByteStream]:
        """The file's bytes from `offset` (a Range request; `ByteStream.offset` says where it really starts)."""
        check_repo_id(repo)
        check_file_name(file)
        if not _REVISION_RE.fullmatch(revision) and revision != "main":
            raise LibraryError(Problem.NO_FILE, f"{shown(revision)!r} is not a revision of {repo}; download it again.")
        url = f"{self.settings.endpoint}/{repo}/resolve/{revision}/{quote(file, safe='/')}"
        headers = {"Accept-Encoding": "identity"}  # the byte count must be the file's
        if offset:
            headers["Range"] = f"bytes={offset}-"
        deadline = time.monotonic() + self.limits.deadline_s  # for the headers; the body has the stall rule
        with _client() as http:
            with self._errors(repo, file):
                response = self._send(http, "GET", url, {}, headers, deadline, self.limits.read_s)
            try:
                if response.status_code == 416:
                    stream = ByteStream(response, offset, complete=True)
                elif response.status_code in (200, 206):
                    start = offset if response.status_code == 206 else 0  # a server that ignores Range sends it all
                    stream = ByteStream(response, start, complete=False)
                else:
                    with self._errors(repo, file):
                        self._raise_status(response, repo, file)
                # Outside `_errors`: what the reader of the stream raises (a full disk, a pause) is its own.
                yield stream
            finally:
                response.close()

    # -- requests --------------------------------------------------------------------------------------------------
    def _send(
        self,
        http: httpx2.Client,
        method: str,
        url: str,
        params: Mapping[str, str],
        headers: Mapping[str, str],
        deadline: float,
        read_s: float | None = None,
    ) -> httpx2.Response:
        """One request, its redirects followed by hand: the token only to the endpoint's origin, at most
        `max_redirects` hops, each under what is left of `deadline` (and each read under `read_s` when given: a
        file's transfer, whose stalls the downloader handles). Returns the streamed response, open."""
        self._check_reachable()
        for _ in range(self.limits.max_redirects + 1):
            if urlsplit(url).scheme.lower() not in ("http", "https"):
                raise LibraryError(
                    Problem.HUB_ERROR, "The Hub redirected to an address that is not http(s); try again later."
                )
            sent = {"User-Agent": f"mlot-spark/{__version__}", **headers}
            if self._token and same_origin(url, self.settings.endpoint):
                sent["Authorization"] = f"Bearer {self._token}"
            request = http.build_request(
                method, url, params=params or None, headers=sent, timeout=self._timeout(deadline, read_s)
            )
            try:
                response = http.send(request, stream=True)
            except httpx2.ConnectError:
                with self._lock:
                    self._unreachable_until = time.monotonic() + self.limits.offline_hold_s
                raise
            if response.status_code not in _REDIRECTS or "location" not in response.headers:
                return response
            location = response.headers["location"]
            response.close()
            url, params = urljoin(str(request.url), location), {}
        raise LibraryError(
            Problem.HUB_ERROR,
            f"The Hub redirected more than {self.limits.max_redirects} times; try again later (or check HF_ENDPOINT).",
        )

    def _get_json(
        self, http: httpx2.Client, url: str, params: Mapping[str, str], deadline: float, repo: str | None, *, what: str
    ) -> tuple[Any, dict[str, str]]:
        """A JSON reply read under `deadline`, bounded in size and nesting, with its `Link` header's targets."""
        response = self._send(http, "GET", url, params, {"Accept": "application/json"}, deadline)
        try:
            if response.status_code != 200:
                self._raise_status(response, repo, None)
            raw = bytearray()
            for chunk in response.iter_bytes():
                raw += chunk
                if len(raw) > self.limits.max_json_bytes:
                    raise LibraryError(Problem.HUB_ERROR, f"The Hub's answer for {what} is too large; try again later.")
                if time.monotonic() > deadline:
                    raise httpx2.ReadTimeout("deadline")
            links = _links(response.headers.get("link", ""), str(response.url))
        finally:
            response.close()
        try:
            return loads_bounded(
                bytes(raw), max_bytes=self.limits.max_json_bytes, max_depth=self.limits.max_json_depth
            ), links
        except ValueError:
            raise _bad_reply(what) from None

    def _timeout(self, deadline: float, read_s: float | None) -> httpx2.Timeout:
        left = deadline - time.monotonic()
        if left <= 0:
            raise httpx2.ReadTimeout("deadline")
        return httpx2.Timeout(min(left, read_s or left), connect=min(left, self.limits.connect_s))

    def _check_reachable(self) -> None:
        with self._lock:
            unreachable = time.monotonic() < self._unreachable_until
        if unreachable:
            raise httpx2.ConnectError("unreachable a moment ago")

    def _raise_status(self, response: httpx2.Response, repo: str | None, file: str | None) -> NoReturn:
        status = response.status_code
        code = response.headers.get("x-error-code", "")
        message = response.headers.get("x-error-message", "")
        name = repo or "the search"
        if code == "GatedRepo":
            raise LibraryError(
                Problem.GATED,
                f"{name} is gated: accept its terms at {self.repo_page(name)} while signed in, set HF_TOKEN to a token "
                "of that account (or run `hf auth login`), then try again.",
            )
        if code == "RepoNotFound" or (status == 404 and file is None and repo is not None):
            raise LibraryError(
                Problem.NOT_FOUND,
                f"{name} was not found on the Hub: check the name (`python -m engine models search` finds GGUF repos); "
                "if it is private, set HF_TOKEN to a token that can read it.",
            )
        if code in ("EntryNotFound", "RevisionNotFound") or (status == 404 and file is not None):
            raise LibraryError(
                Problem.NO_FILE,
                f"{name} has no file {shown(file or '')}; choose one of the repo's GGUF files (run the download "
                "without --file to see them).",
            )
        if status in (401, 403):
            detail = " (invalid credentials)" if "credentials" in message.lower() else ""
            raise LibraryError(
                Problem.FORBIDDEN,
                f"The Hub refused access to {name} ({status}{detail}): set HF_TOKEN to a valid token with read access "
                "(or run `hf auth login`), then try again.",
            )
        if status in (429, 503):
            wait = _retry_after(response.headers.get("retry-after"))
            when = f"in {wait:.0f} s" if wait is not None and wait <= 3600 else "later"
            raise LibraryError(Problem.HUB_ERROR, f"The Hub is busy ({status}) and asks to wait: try again {when}.")
        raise LibraryError(Problem.HUB_ERROR, f"The Hub answered {status} for {name}; try again in a few minutes.")

    @contextmanager
    def _errors(self, repo: str | None, file: str | None = None) -> Iterator[None]:
        """Every failure of the transport, the reply or the disk below as one `LibraryError` (by family: httpx2's
        errors, OS errors, bad replies), so nothing from below reaches the user as a traceback."""
        if self.settings.offline:
            _offline()
        try:
            yield
        except LibraryError:
            raise
        except (httpx2.TimeoutException, TimeoutError):
            raise LibraryError(
                Problem.NO_NETWORK,
                f"The Hub at {shown(self.settings.endpoint)} did not answer in time: check the network connection, then "
                "try again; a download resumes where it stopped.",
            ) from None
        except (httpx2.HTTPError, httpx2.InvalidURL, httpx2.StreamError, OSError):
            raise LibraryError(
                Problem.NO_NETWORK,
                f"Cannot reach the Hugging Face Hub at {shown(self.settings.endpoint)}: check the network connection "
                "(and HF_ENDPOINT if you set it), then try again; a download resumes where it stopped.",
            ) from None


def _client() -> httpx2.Client:
    # One per call (closed with it); proxies from the environment are honoured, redirects are followed by hand.
    return httpx2.Client(follow_redirects=False, trust_env=True)


def _offline() -> NoReturn:
    raise LibraryError(
        Problem.OFFLINE,
        "Offline mode is on (HF_HUB_OFFLINE): unset it to search or download; downloaded models and the default "
        "model keep working.",
    )


def _bad_reply(what: str) -> LibraryError:
    return LibraryError(
        Problem.HUB_ERROR,
        f"The Hub's answer for {what} is not what a Hub sends (not JSON, or nested too deep); check HF_ENDPOINT, or "
        "try again later.",
    )


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds when it is a plain, sane number (an HTTP date or a huge figure reads as None)."""
    if value is None or not value.strip().isdigit() or len(value.strip()) > 9:
        return None
    return float(value.strip())


_LINK_RE = re.compile(r'<([^>]{1,2000})>\s*;\s*rel="?([a-z]+)"?')


def _links(header: str, base: str) -> dict[str, str]:
    return {rel: urljoin(base, target) for target, rel in _LINK_RE.findall(header[:8000])}


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62 else 0


def _repo_entry(m: Any) -> HubRepo | None:
    if not isinstance(m, dict):
        return None
    rid = m.get("id", m.get("modelId"))
    if not isinstance(rid, str) or repo_id_problem(rid) is not None:
        return None
    return HubRepo(rid, _count(m.get("downloads")), _count(m.get("likes")), bool(m.get("gated")))


def _file_entry(s: Any) -> HubFile | None:
    if not isinstance(s, dict):
        return None
    name = s.get("rfilename")
    if not isinstance(name, str) or file_name_problem(name) is not None:
        return None
    low = name.lower()
    if not low.endswith(".gguf") or _SPLIT_RE.search(name):
        return None
    lfs = s.get("lfs")
    size = lfs.get("size") if isinstance(lfs, dict) else s.get("size")
    sha = lfs.get("sha256") if isinstance(lfs, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or size >= 1 << 50:
        return None
    # The sha256 names the partial download's file: only 64 hex digits are taken from the Hub.
    return HubFile(name, size, sha if isinstance(sha, str) and _SHA256_RE.fullmatch(sha) else None)


def _is_projector(name: str) -> bool:
    """llama.cpp's vision projector file (`mmproj*.gguf`), not a model."""
    return name.lower().rsplit("/", 1)[-1].startswith("mmproj")


class Stalled(Exception):
    """No bytes arrived for `read_s`; the transfer can be asked for again from where it stopped."""


@dataclass
class ByteStream:
    response: httpx2.Response  # the open response
    offset: int  # where its first byte sits in the file
    complete: bool  # the server says nothing lies past `offset` (416)

    def chunks(self) -> Iterator[bytes]:
        """The body's bytes as they arrive (each piece as soon as the network gives it, so a slow transfer still
        reaches the downloader's pause, cancel and stall checks)."""
        if self.complete:
            return
        try:
            yield from self.response.iter_bytes()  # as they arrive (no chunk size: nothing waits to fill one)
        except httpx2.ReadTimeout:
            raise Stalled() from None
        except (httpx2.HTTPError, httpx2.StreamError, OSError):
            raise LibraryError(
                Problem.NO_NETWORK,
                "The connection to the Hub dropped during the download: check the network, then run the same "
                "download again; it resumes where it stopped.",
            ) from None
