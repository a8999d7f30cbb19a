"""OpenAI's Files API on the server (engine.openai.files): upload, list, retrieve, delete with the `openai` client,
and hostile uploads refused in one sentence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.mark.parametrize(
    "file_id", ["file-0123456789abcdef01234567", "file-..", "passwd", "file-XYZ", "file-" + "a" * 300]
)
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
    with pytest.raises(openai.BadRequestError, match=r"(?i)pdf"):
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


# -- a chat that attaches an uploaded file ---------------------------------------------------------------------------

FILLER = "".join(f"Line {i} of the harbour log says the tide was ordinary that day.\n" for i in range(40))
DOC = (FILLER + "The lighthouse keeper's cat is named Biscuit.\n" + FILLER).encode()


def metric(s: Served, name: str) -> float:
    text = httpx.get(s.url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def ask(file_id: str | None, question: str = "What is the cat's name?") -> Any:
    parts: list[dict[str, object]] = [{"type": "text", "text": question}]
    if file_id is not None:
        parts.append({"type": "file", "file": {"file_id": file_id}})
    return [{"role": "user", "content": parts}]


def test_chat_attaches_a_file_reads_it_once_and_says_what_it_recalled(served: Served) -> None:
    c = client(served)
    f = c.files.create(file=("harbour.txt", DOC), purpose="user_data")
    read0, tokens0 = metric(served, "spark_document_read_tokens_total"), metric(served, "spark_document_tokens_total")
    r = c.chat.completions.create(model="tiny", messages=ask(f.id), max_tokens=3, temperature=0)
    recalled = (r.choices[0].message.model_extra or {})["recalled"]
    assert recalled and all(p["source"] == "harbour.txt" and 1 <= p["start"] <= p["end"] <= 81 for p in recalled)
    first_read = metric(served, "spark_document_read_tokens_total") - read0
    tokens = metric(served, "spark_document_tokens_total") - tokens0
    assert first_read == tokens > 200  # the whole document was read through the model, once

    # The second question (streamed) finds the capsule in the persistent store: nothing is read again.
    stream = c.chat.completions.create(
        model="tiny",
        messages=ask(f.id, "And the tide?"),
        max_tokens=3,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    last = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason is not None][-1]
    again = (last.choices[0].delta.model_extra or {})["recalled"]
    assert again and {p["source"] for p in again} == {"harbour.txt"}
    assert metric(served, "spark_document_read_tokens_total") - read0 == first_read
    assert metric(served, "spark_document_tokens_total") - tokens0 == 2 * tokens

    # A request without the file: no attachments are left on the rows, and no extension field.
    plain = c.chat.completions.create(model="tiny", messages=ask(None), max_tokens=2, temperature=0)
    assert "recalled" not in (plain.choices[0].message.model_extra or {})
    for memory in served.service.memories:
        assert not getattr(memory, "attachments", [])
    c.files.delete(f.id)


def test_file_parts_that_cannot_be_attached(served: Served) -> None:
    c = client(served)
    with pytest.raises(openai.NotFoundError, match="No such file"):
        c.chat.completions.create(model="tiny", messages=ask("file-" + "0" * 24), max_tokens=1)
    with pytest.raises(openai.NotFoundError, match="No such file"):
        c.chat.completions.create(model="tiny", messages=ask("/etc/passwd"), max_tokens=1)
    inline: Any = [
        {"role": "user", "content": [{"type": "file", "file": {"file_data": "data:text/plain;base64,eA=="}}]}
    ]
    with pytest.raises(openai.BadRequestError, match="POST /v1/files"):
        c.chat.completions.create(model="tiny", messages=inline, max_tokens=1)
    f = c.files.create(file=("a.txt", FACT), purpose="user_data")
    as_system: Any = [{"role": "system", "content": [{"type": "file", "file": {"file_id": f.id}}]}]
    with pytest.raises(openai.BadRequestError, match="text parts"):
        c.chat.completions.create(model="tiny", messages=as_system, max_tokens=1)
    many = [c.files.create(file=(f"{i}.txt", FACT), purpose="user_data") for i in range(33)]
    parts: Any = [{"type": "file", "file": {"file_id": g.id}} for g in many]
    with pytest.raises(openai.BadRequestError, match="at most 32 files"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=1)
    for g in [f, *many]:
        c.files.delete(g.id)


def test_a_memory_without_the_cascade_cannot_attach() -> None:
    from engine.openai.documents import check_attachable
    from engine.openai.errors import ApiError

    with pytest.raises(ApiError, match="cannot attach files") as err:
        check_attachable(None)
    assert err.value.status == 400
