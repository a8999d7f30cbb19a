"""The Hugging Face Hub, through `huggingface_hub`: search GGUF repos, list a repo's GGUF files with their sizes and
sha256, and open a file's byte stream from an offset (the downloader resumes with it).

`HF_ENDPOINT` (a mirror, or the tests' loopback Hub), `HF_TOKEN` (or the token `hf auth login` stored) and
`HF_HUB_OFFLINE` are read when a client is made, not when the module is imported. Every Hub failure becomes a
`LibraryError`: one sentence saying what to do, and a `Problem` the app can act on.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import httpx2
from huggingface_hub import HfApi, get_hf_file_metadata, get_session, hf_hub_url, hf_raise_for_status
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils._headers import build_hf_headers

from engine.errors import SparkError

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 20.0
# A transfer waits this long for its next bytes before the downloader checks for pause/cancel and asks again, so a
# pause is prompt even while the network stalls.
READ_TIMEOUT_S = 2.0
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)  # one part of a split GGUF
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


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

    def file(self, name: str) -> HubFile | None:
        return next((f for f in self.files if f.name == name), None)


def check_repo_id(repo: str) -> None:
    if not _REPO_RE.fullmatch(repo):
        raise LibraryError(Problem.NOT_FOUND, f"{repo!r} is not a Hub repo id; write it as owner/name.")


class HubClient:
    def __init__(self, settings: HubSettings | None = None) -> None:
        self.settings = settings or HubSettings.from_env()
        self._api = HfApi(endpoint=self.settings.endpoint, token=self.settings.token)

    def repo_page(self, repo: str) -> str:
        return f"{self.settings.endpoint}/{repo}"

    def search(self, query: str, limit: int = 20) -> list[HubRepo]:
        """GGUF model repos matching `query`, most downloaded first."""
        with self._errors(query):
            found = self._api.list_models(search=query, filter="gguf", sort="downloads", limit=limit)
            return [
                HubRepo(m.id, int(m.downloads or 0), int(m.likes or 0), bool(m.gated))
                for m in found
                if isinstance(m.id, str)
            ]

    def repo_files(self, repo: str) -> RepoFiles:
        """The repo's single-file GGUF models (split parts and vision projectors left out), with size and sha256."""
        check_repo_id(repo)
        with self._errors(repo):
            info = self._api.model_info(repo, files_metadata=True)
        files = []
        for s in info.siblings or []:
            name = s.rfilename
            low = name.lower()
            if not low.endswith(".gguf") or _SPLIT_RE.search(name) or low.rsplit("/", 1)[-1].startswith("mmproj"):
                continue
            size = s.lfs.size if s.lfs is not None else s.size
            sha = s.lfs.sha256 if s.lfs is not None else None
            if isinstance(size, int) and size >= 0:
                # The sha256 names the partial download's file: only 64 hex digits are taken from the Hub.
                files.append(HubFile(name, size, sha if isinstance(sha, str) and _SHA256_RE.fullmatch(sha) else None))
        arch = info.gguf.get("architecture") if isinstance(info.gguf, dict) else None
        return RepoFiles(
            repo=repo,
            revision=str(info.sha or "main"),
            gated=bool(info.gated),
            architecture=arch if isinstance(arch, str) else None,
            files=tuple(files),
        )

    @contextmanager
    def open_stream(self, repo: str, file: str, revision: str, offset: int) -> Iterator[ByteStream]:
        """The file's bytes from `offset` (a Range request; `ByteStream.offset` says where it really starts)."""
        url = hf_hub_url(repo, file, revision=revision, endpoint=self.settings.endpoint)
        with self._errors(repo, file):
            meta = get_hf_file_metadata(url, token=self.settings.token, endpoint=self.settings.endpoint)
            headers = build_hf_headers(token=self.settings.token)
            headers["Accept-Encoding"] = "identity"  # the byte count must be the file's
            location = meta.location or url
            if not location.startswith(self.settings.endpoint):
                headers.pop("authorization", None)  # a CDN's signed URL carries its own authority
            if offset:
                headers["Range"] = f"bytes={offset}-"
            timeout = httpx2.Timeout(TIMEOUT_S, read=READ_TIMEOUT_S)
            with get_session().stream("GET", location, headers=headers, timeout=timeout) as response:
                if response.status_code == 416:
                    yield ByteStream(response, offset, meta.etag, complete=True)
                    return
                hf_raise_for_status(response)
                start = offset if response.status_code == 206 else 0  # a server that ignores Range sends it all
                yield ByteStream(response, start, meta.etag, complete=False)

    @contextmanager
    def _errors(self, repo: str, file: str | None = None) -> Iterator[None]:
        if self.settings.offline:
            _offline()
        try:
            yield
        except OfflineModeIsEnabled:
            _offline()
        except GatedRepoError:
            raise LibraryError(
                Problem.GATED,
                f"{repo} is gated: accept its terms at {self.repo_page(repo)} while signed in, set HF_TOKEN to a token of "
                "that account (or run `hf auth login`), then try again.",
            ) from None
        except RepositoryNotFoundError:
            raise LibraryError(
                Problem.NOT_FOUND,
                f"{repo} was not found on the Hub: check the name (`python -m engine models search` finds GGUF repos); "
                "if it is private, set HF_TOKEN to a token that can read it.",
            ) from None
        except (EntryNotFoundError, RevisionNotFoundError):
            raise LibraryError(
                Problem.NO_FILE,
                f"{repo} has no file {file}; choose one of the repo's GGUF files (run the download without --file to see them).",
            ) from None
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            if status in (401, 403):
                raise LibraryError(
                    Problem.FORBIDDEN,
                    f"The Hub refused access to {repo} ({status}): set HF_TOKEN to a valid token with read access "
                    "(or run `hf auth login`), then try again.",
                ) from None
            raise LibraryError(
                Problem.HUB_ERROR,
                f"The Hub answered {status or 'an error'} for {repo}; try again in a few minutes.",
            ) from None
        except (httpx2.TransportError, ConnectionError, TimeoutError):
            raise LibraryError(
                Problem.NO_NETWORK,
                f"Cannot reach the Hugging Face Hub at {self.settings.endpoint}: check the network connection "
                "(and HF_ENDPOINT if you set it), then try again; a download resumes where it stopped.",
            ) from None


def _offline() -> NoReturn:
    raise LibraryError(
        Problem.OFFLINE,
        "Offline mode is on (HF_HUB_OFFLINE): unset it to search or download; downloaded models and the default "
        "model keep working.",
    )


class Stalled(Exception):
    """No bytes arrived for READ_TIMEOUT_S; the transfer can be asked for again from where it stopped."""


@dataclass
class ByteStream:
    response: Any  # the open httpx2 response
    offset: int  # where its first byte sits in the file
    etag: str | None  # the Hub's ETag (an LFS file's is its sha256)
    complete: bool  # the server says nothing lies past `offset` (416)

    def chunks(self, size: int) -> Iterator[bytes]:
        if self.complete:
            return
        try:
            yield from self.response.iter_bytes(chunk_size=size)
        except httpx2.ReadTimeout:
            raise Stalled() from None
        except (httpx2.TransportError, ConnectionError, TimeoutError):
            raise LibraryError(
                Problem.NO_NETWORK,
                "The connection to the Hub dropped during the download: check the network, then run the same "
                "download again; it resumes where it stopped.",
            ) from None
