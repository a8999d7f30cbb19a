"""The model library against a Hub that lies and a models folder someone else wrote into: the token stays on the
endpoint's origin, every call ends (stalls, drips, loops, endless pages, years-long Retry-After), hostile names are
refused or escaped, downloads never write through a link, and `models list` neither hangs nor breaks."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import SparkError
from engine.library.download import Downloader
from engine.library.hub import HubClient, HubLimits, HubSettings, LibraryError, Problem
from engine.library.library import Library
from engine.library.names import file_name_problem
from engine.library.store import MANIFEST, ModelStore
from tests.engine.library.helpers import FILE, REPO, make_library
from tests.helpers.fake_hub import FakeHub, running_hub
from tests.helpers.fuzz import fuzz_examples

QUICK = HubLimits(deadline_s=2.0, connect_s=2.0, read_s=0.3, max_pages=4, max_redirects=3)
MARKER = "hf_marker_token"
HOSTILE_NAMES = [
    "nul\x00name.gguf",
    "ansi\x1b[2Jclear.gguf",
    "bidi\u202eevil.gguf",
    "zero\u200bwidth.gguf",
    "new\nline.gguf",
    "x" * 10_000 + ".gguf",
    "../escape.gguf",
    "a/../../b.gguf",
    "back\\slash.gguf",
    ".hidden.gguf",
    "dir/.hidden.gguf",
    "/absolute.gguf",
]


def _fails(problem: Problem | None, call: Callable[[], object]) -> str:
    with pytest.raises(SparkError) as info:
        call()
    if problem is not None:
        assert isinstance(info.value, LibraryError) and info.value.problem is problem, str(info.value)
    message = str(info.value)
    assert message.isprintable() and message.endswith("."), repr(message)  # one line, nothing that drives a terminal
    assert len(message) < 1000
    return message


@pytest.fixture
def other_hub(tiny_gguf: bytes) -> Iterator[FakeHub]:
    """A second origin (another port on loopback) serving the same repo."""
    with running_hub() as fake:
        fake.add(REPO, {FILE: tiny_gguf})
        yield fake


# -- the token -----------------------------------------------------------------------------------------------------


def test_a_next_page_on_another_origin_is_not_asked_for(hub: FakeHub, other_hub: FakeHub, tmp_path: Path) -> None:
    library = make_library(hub, tmp_path / "m", token=MARKER, limits=QUICK)
    hub.hostile.link_next = f"{other_hub.endpoint}/api/models?page=2"
    assert [r.id for r in library.hub.search("tiny", limit=5)] == [REPO]
    assert other_hub.requests == []
    assert hub.requests[0].authorization == f"Bearer {MARKER}"  # the endpoint itself does get it


def test_a_redirect_to_another_origin_drops_the_token(
    hub: FakeHub, other_hub: FakeHub, tmp_path: Path, tiny_gguf: bytes
) -> None:
    library = make_library(hub, tmp_path / "m", token=MARKER, limits=QUICK)
    hub.hostile.file_redirect = f"{other_hub.endpoint}/{REPO}/resolve/main/{FILE}"
    model = library.downloader().download(REPO)
    assert model.path.read_bytes() == tiny_gguf
    assert other_hub.requests and all(r.authorization is None for r in other_hub.requests)


def test_a_dotted_file_name_never_reaches_the_hub(hub: FakeHub, tmp_path: Path) -> None:
    library = make_library(hub, tmp_path / "m", token=MARKER, limits=QUICK)
    for name in ("../../api/whoami.gguf", "a/../b.gguf", ".hidden.gguf", "back\\slash.gguf"):
        _fails(Problem.BAD_FILE, lambda name=name: library.downloader().download(REPO, name))  # type: ignore[misc]
        _fails(Problem.BAD_FILE, lambda name=name: library.hub.open_stream(REPO, name, "main", 0).__enter__())  # type: ignore[misc]
    assert hub.requests == []


# -- names ---------------------------------------------------------------------------------------------------------


def test_hostile_sibling_names_are_not_offered(library: Library, hub: FakeHub) -> None:
    hub.hostile.siblings = HOSTILE_NAMES
    files = library.hub.repo_files(REPO)
    assert [f.name for f in files.files] == [FILE]


def test_hostile_names_are_one_escaped_sentence(library: Library) -> None:
    for name in HOSTILE_NAMES:
        message = _fails(None, lambda name=name: library.downloader().download(REPO, name))  # type: ignore[misc]
        assert "\x1b" not in message and "\u202e" not in message
    for repo in ("owner/na\x1b[2Jme", "owner/" + "n" * 10_000, "own\u202eer/name", "owner/../x", "a/b/c"):
        _fails(Problem.NOT_FOUND, lambda repo=repo: library.downloader().download(repo))  # type: ignore[misc]


def test_search_results_with_hostile_ids_are_left_out(library: Library, hub: FakeHub) -> None:
    rows = [{"id": REPO, "downloads": 5}, {"id": "evil/\x1b[2J"}, {"id": "x" * 500}, {"id": 3}, "not a dict"]
    hub.hostile.body = json.dumps(rows).encode()
    assert [r.id for r in library.hub.search("tiny")] == [REPO]


# -- every call ends -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["stall", "drip"])
def test_a_hub_that_stalls_or_drips_ends_in_one_sentence(hub: FakeHub, tmp_path: Path, kind: str) -> None:
    library = make_library(hub, tmp_path / "m", limits=QUICK)
    if kind == "stall":
        hub.hostile.stall_after_headers = True
    else:
        hub.hostile.body, hub.hostile.drip_s = json.dumps([{"id": REPO}] * 200).encode(), 0.05
    _fails(Problem.NO_NETWORK, lambda: library.hub.search("tiny"))
    _fails(Problem.NO_NETWORK, lambda: library.hub.repo_files(REPO))


def test_retry_after_of_years_is_reported_not_obeyed(library: Library, hub: FakeHub) -> None:
    for wait in ("100000000", "99999999999999999999999", "Wed, 21 Oct 2099 07:28:00 GMT", "-5"):
        hub.requests.clear()
        hub.hostile.status, hub.hostile.retry_after = 429, wait
        message = _fails(Problem.HUB_ERROR, lambda: library.hub.search("tiny"))
        assert "busy" in message and "later" in message
        assert len(hub.requests) == 1  # no retry storm
    hub.hostile.retry_after = "30"
    assert "in 30 s" in _fails(Problem.HUB_ERROR, lambda: library.hub.repo_files(REPO))


def test_a_server_error_is_one_request_and_one_line(library: Library, hub: FakeHub) -> None:
    hub.hostile.status = 500
    _fails(Problem.HUB_ERROR, lambda: library.hub.repo_files(REPO))
    assert len(hub.requests) == 1


def test_redirect_loops_and_endless_pages_are_bounded(library: Library, hub: FakeHub) -> None:
    hub.hostile.redirect_loop = True
    assert "redirected" in _fails(Problem.HUB_ERROR, lambda: library.hub.search("tiny"))
    assert len(hub.requests) == library.hub.limits.max_redirects + 1
    hub.hostile.redirect_loop = False
    hub.requests.clear()
    hub.hostile.link_next = f"{hub.endpoint}/api/models?page={{n}}"
    library.hub.search("nothing matches this")
    assert len(hub.requests) == library.hub.limits.max_pages


@pytest.mark.parametrize(
    "body",
    [b"<html><body>proxy login</body></html>", b'{"not": "a list"}', b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe"],
)
def test_replies_that_are_not_the_hubs_are_one_sentence(library: Library, hub: FakeHub, body: bytes) -> None:
    hub.hostile.body = body
    assert "not what a Hub sends" in _fails(Problem.HUB_ERROR, lambda: library.hub.search("tiny"))
    if body.startswith(b"{"):  # an object where the info's object belongs: a repo with no files
        assert library.hub.repo_files(REPO).files == ()
    else:
        _fails(Problem.HUB_ERROR, lambda: library.hub.repo_files(REPO))


def test_an_unreachable_hub_is_detected_once(monkeypatch: pytest.MonkeyPatch) -> None:
    client = HubClient(HubSettings(endpoint="http://127.0.0.1:9", token=None, offline=False), QUICK)
    _fails(Problem.NO_NETWORK, lambda: client.search("tiny"))

    def no_second_attempt(*_a: object, **_k: object) -> None:
        raise AssertionError("the Hub was asked again while known to be unreachable")

    monkeypatch.setattr(httpx2.Client, "send", no_second_attempt)
    _fails(Problem.NO_NETWORK, lambda: client.repo_files(REPO))
    _fails(Problem.NO_NETWORK, lambda: client.search("tiny"))


def test_a_dripping_download_stops_as_stalled(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos[REPO].files[FILE].drip_s = 0.01
    library = make_library(hub, tmp_path / "m", limits=QUICK)
    slow = Downloader(
        library.hub, library.store, free_space=lambda _p: 1 << 40, stall_window_s=0.5, stall_min_bytes=1 << 20
    )
    assert "less than" in _fails(Problem.NO_NETWORK, lambda: slow.download(REPO))
    assert [p.source.file for p in library.store.partials()] == [FILE]  # what came is kept: it resumes


# -- the models folder ---------------------------------------------------------------------------------------------


def _part(root: Path, data: bytes) -> Path:
    folder = root / ".downloads"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{hashlib.sha256(data).hexdigest()}.part"


@pytest.mark.parametrize("link", ["symlink", "hardlink", "fifo", "folder"])
def test_a_part_file_that_is_not_the_stores_is_never_written_through(
    hub: FakeHub, tmp_path: Path, tiny_gguf: bytes, link: str
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"twelve bytes")
    library = make_library(hub, tmp_path / "models")
    part = _part(library.store.root, tiny_gguf)
    if link == "symlink":
        part.symlink_to(outside)
    elif link == "hardlink":
        os.link(outside, part)
    elif link == "fifo":
        os.mkfifo(part)
    else:
        part.mkdir()
    model = library.downloader().download(REPO)
    assert model.path.read_bytes() == tiny_gguf
    assert outside.read_bytes() == b"twelve bytes"


def test_a_part_swapped_for_a_link_before_a_resume_is_rechecked(hub: FakeHub, tmp_path: Path, tiny_gguf: bytes) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"twelve bytes")
    hub.repos[REPO].files[FILE].cut_after = 3 << 20  # the transfer drops: a partial file is left to resume
    library = make_library(hub, tmp_path / "models")
    _fails(Problem.NO_NETWORK, lambda: library.downloader().download(REPO))
    part = _part(library.store.root, tiny_gguf)
    assert part.stat().st_size == 3 << 20
    part.unlink()
    part.symlink_to(outside)
    hub.repos[REPO].files[FILE].cut_after = None
    model = library.downloader().download(REPO)
    assert model.path.read_bytes() == tiny_gguf
    assert outside.read_bytes() == b"twelve bytes"
    assert hub.downloads_of(FILE)[-1].range is None  # started again from the first byte, not appended


def test_a_linked_downloads_folder_is_refused(hub: FakeHub, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    library = make_library(hub, tmp_path / "models")
    library.store.root.mkdir()
    (library.store.root / ".downloads").symlink_to(elsewhere, target_is_directory=True)
    assert "link" in _fails(None, lambda: library.downloader().download(REPO))
    assert list(elsewhere.iterdir()) == []


def _listed_in_time(store: ModelStore) -> list[str]:
    names: list[str] = []
    t = threading.Thread(target=lambda: names.extend(m.name for m in store.models()), daemon=True)
    t.start()
    t.join(timeout=60)  # a generous bound on a hang, not a figure measured
    assert not t.is_alive(), "listing the models folder hung"
    return names


def test_list_passes_over_fifos_links_and_deep_manifests(library: Library, tmp_path: Path) -> None:
    good = library.downloader().download(REPO)
    root = library.store.root
    (root / "fifo-model").mkdir()
    os.mkfifo(root / "fifo-model" / MANIFEST)
    (root / "deep-model").mkdir()
    (root / "deep-model" / MANIFEST).write_text("[" * 200_000 + "]" * 200_000)
    (root / "big-model").mkdir()
    (root / "big-model" / MANIFEST).write_bytes(b" " * (1 << 20) + b"{}")
    (root / "linked-model").symlink_to(good.path.parent, target_is_directory=True)
    (root / "linked-manifest").mkdir()
    (root / "linked-manifest" / MANIFEST).symlink_to(good.path.parent / MANIFEST)
    os.mkfifo(root / ".downloads" / f"{'a' * 64}.json")
    assert _listed_in_time(library.store) == [good.name]
    assert library.store.partials() == []


def test_a_disk_that_fills_mid_download_is_said_to_be_full(library: Library, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of the disk while the Hub's stream is open is the disk's, not reported as the network's."""
    real = ModelStore.open_partial

    class Full:
        def __init__(self, f: Any) -> None:
            self.f = f

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    @contextlib.contextmanager
    def full(self: ModelStore, part: Path) -> Iterator[Full]:
        with real(self, part) as f:
            yield Full(f)

    monkeypatch.setattr(ModelStore, "open_partial", full)
    assert "free" in _fails(Problem.DISK_FULL, lambda: library.downloader().download(REPO))


def test_a_slow_but_moving_download_is_not_a_stall(hub: FakeHub, tmp_path: Path) -> None:
    """200 bytes, one every 5 ms: above the stall rule's floor (10 bytes per 0.2 s), so the transfer completes and
    only then is the file judged (it is not a GGUF)."""
    hub.add("spark-tests/slow-GGUF", {"slow.gguf": bytes(range(200))})
    hub.repos["spark-tests/slow-GGUF"].files["slow.gguf"].drip_s = 0.005
    library = make_library(hub, tmp_path / "m", limits=QUICK)
    slow = Downloader(library.hub, library.store, free_space=lambda _p: 1 << 40, stall_window_s=0.2, stall_min_bytes=10)
    _fails(Problem.BAD_FILE, lambda: slow.download("spark-tests/slow-GGUF"))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30,
)
SIBLING = st.fixed_dictionaries(
    {"rfilename": st.text(max_size=40) | st.sampled_from([FILE, "../x.gguf", "a\x00.gguf"])},
    optional={"size": JSON_VALUES | st.integers(), "lfs": JSON_VALUES},
)


@settings(
    max_examples=fuzz_examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    body=JSON_VALUES
    | st.fixed_dictionaries(
        {"siblings": st.lists(SIBLING, max_size=5)}, optional={"sha": JSON_VALUES, "gguf": JSON_VALUES}
    )
)
def test_fuzz_hub_replies(library: Library, hub: FakeHub, body: object) -> None:
    """Whatever JSON a Hub answers, a search and a file list are a result or one sentence; a file offered has a
    name that passed the checks and a size that is a whole number."""
    hub.hostile.body = json.dumps(body).encode()
    for call in (lambda: library.hub.search("x"), lambda: library.hub.repo_files(REPO)):
        try:
            result = call()
        except LibraryError as exc:
            assert str(exc).isprintable() and str(exc).endswith(".")
            continue
        if not isinstance(result, list):
            assert all(file_name_problem(f.name) is None and f.size_bytes >= 0 for f in result.files)


def test_the_store_stays_light() -> None:
    """The store (read by the app's model menu at start-up) checks names without importing the network stack."""
    import subprocess
    import sys

    code = "import sys, engine.library.store; print(sorted({'httpx2', 'huggingface_hub'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
