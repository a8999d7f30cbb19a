"""OpenAI's Files API on the server (engine.openai.files): upload, list, retrieve, delete with the `openai` client,
and hostile uploads refused in one sentence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.openai.files import FileLimits, FileStore
from tests.helpers.server import KEY, Served, start_server

FACT = b"The lighthouse keeper's cat is named Biscuit.\n"


@pytest.fixture(scope="module")
def small(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server whose file store holds 2 files of at most 4 KiB, 6 KiB in all."""
    limits = FileLimits(max_file_bytes=4096, max_files=2, max_total_bytes=6144)
    s = start_server(tiny_dir, tmp_path_factory.mktemp("kv-files"), files=limits)
    yield s
    s.server.stop()


def client(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url, api_key=KEY, max_retries=0)


def test_upload_list_retrieve_delete(served: Served) -> None:
    c = client(served)
    f = c.files.create(file=("notes.txt", FACT), purpose="user_data")
    assert f.id.startswith("file-") and f.object == "file"
    assert (f.filename, f.bytes, f.purpose) == ("notes.txt", len(FACT), "user_data")
    assert f.id in [x.id for x in c.files.list()]
    assert c.files.retrieve(f.id).filename == "notes.txt"
    assert c.files.delete(f.id).deleted
    assert f.id not in [x.id for x in c.files.list()]
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)


@pytest.mark.parametrize("file_id", ["file-0123456789abcdef01234567", "file-..", "passwd", "file-XYZ", "file-" + "a" * 300])
def test_unknown_or_malformed_id_is_404_in_openai_shape(served: Served, file_id: str) -> None:
    r = httpx.get(f"{served.url}/files/{file_id}", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404
    assert "No such file" in r.json()["error"]["message"]
    r = httpx.delete(f"{served.url}/files/{file_id}", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404


def test_files_need_the_key(served: Served) -> None:
    assert httpx.get(f"{served.url}/files").status_code == 401


def test_hostile_uploads_are_refused(small: Served) -> None:
    c = client(small)
    with pytest.raises(openai.APIStatusError) as big:
        c.files.create(file=("big.txt", b"x" * 70_000), purpose="user_data")
    assert big.value.status_code == 413 and "4,096 bytes" in str(big.value)
    with pytest.raises(openai.BadRequestError, match="not a document"):
        c.files.create(file=("blob.bin", b"\0\1\2" * 100), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="PDF|pdf"):
        c.files.create(file=("broken.pdf", b"%PDF-1.7\nnot really"), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        c.files.create(file=("a.txt", FACT), purpose="nonsense")  # type: ignore[arg-type]
    # The name is a label only: a path in it is cut to its last part, and the stored file has our own name.
    f = c.files.create(file=("../../evil/../x.md", FACT), purpose="user_data")
    assert f.filename == "x.md"
    # Bounded: a third file (count), then bytes, are refused until one is deleted.
    g = c.files.create(file=("y.txt", b"y" * 4000), purpose="user_data")
    with pytest.raises(openai.APIStatusError, match="delete one first") as full:
        c.files.create(file=("z.txt", FACT), purpose="user_data")
    assert full.value.status_code == 413
    c.files.delete(f.id)
    with pytest.raises(openai.APIStatusError, match="does not fit"):
        c.files.create(file=("w.txt", b"w" * 3000), purpose="user_data")
    c.files.delete(g.id)


def test_not_multipart_and_malformed_forms(small: Served) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{small.url}/files", headers=h, json={"file": "x"})
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    bad = {**h, "content-type": "multipart/form-data; boundary=zz"}
    r = httpx.post(f"{small.url}/files", headers=bad, content=b"--zz\r\ngarbage")
    assert r.status_code == 400
    r = httpx.post(f"{small.url}/files", headers=h, data={"purpose": "user_data"})
    assert r.status_code == 400


def test_store_removes_its_folder(tmp_path: Path) -> None:
    store = FileStore(parent=tmp_path)
    f = store.add("../../a.txt", "user_data", FACT)
    assert [p.name for p in store.root.iterdir()] == [f.id] and store.root.parent == tmp_path
    assert (store.root / f.id).read_bytes() == FACT and store.document(f.id).name == "a.txt"
    store.close()
    assert not store.root.exists()
