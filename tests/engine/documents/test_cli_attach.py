"""`generate --attach/--recall-session --json` and `chat` `/attach`, `/recall` on the tiny model: the JSON keys of
the contract, a second run reading nothing new into the cache, hostile files refused in one sentence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.engine.documents.pdfs import encrypted_pdf
from tests.helpers.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[3]


def engine_cli(*args: str, cache: Path, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "MLOT_SPARK_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], capture_output=True, env=env, cwd=ROOT, timeout=600, input=stdin
    )


def cache_files(cache: Path) -> set[str]:
    return {p.name for p in cache.rglob("*.safetensors")}


def test_generate_attach_json_and_a_second_run_reads_nothing(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    doc = tmp_path / "notes.md"
    doc.write_text("\n".join(f"Note {i}: the quick brown fox." for i in range(80)))
    cache = tmp_path / "cache"
    common = ["generate", "--model", str(model), "--prompt", "The quick", "--max-tokens", "4", "--greedy", "--json"]
    first = engine_cli(*common, "--attach", str(doc), "--cache-dir", str(cache), cache=cache)
    assert first.returncode == 0, first.stderr.decode()
    out = json.loads(first.stdout)
    assert out["document_tokens"] >= 80 * 8
    assert out["recalled"] and all({"source", "start", "end"} <= set(r) for r in out["recalled"])
    assert all(r["source"] == "notes.md" and 1 <= r["start"] <= r["end"] <= 80 for r in out["recalled"])
    stored = cache_files(cache)
    again = engine_cli(*common, "--attach", str(doc), "--cache-dir", str(cache), cache=cache)
    assert again.returncode == 0, again.stderr.decode()
    assert cache_files(cache) == stored  # the capsule was found: no block read or written again
    assert json.loads(again.stdout)["tokens"] == out["tokens"]
    plain = json.loads(engine_cli(*common, "--cache-dir", str(cache), cache=cache).stdout)
    assert "recalled" not in plain and "document_tokens" not in plain


def test_recall_session_and_chat_commands(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    cache = tmp_path / "cache"
    saved = tmp_path / "earlier.spark"
    r = engine_cli("generate", "--model", str(model), "--prompt", "The lazy dog", "--chat", "--max-tokens", "3",
                   "--save-session", str(saved), "--cache-dir", str(cache), cache=cache)  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    r = engine_cli("generate", "--model", str(model), "--prompt", "dog", "--max-tokens", "3", "--json",
                   "--recall-session", str(saved), "--cache-dir", str(cache), cache=cache)  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["document_tokens"] > 0
    doc = tmp_path / "a.txt"
    doc.write_text("The quick brown fox.\n" * 40)
    script = f"/attach {doc}\n/recall {saved}\n/attach {doc}\nquick\n/quit\n".encode()
    r = engine_cli("chat", "--model", str(model), "--max-tokens", "3", "--cache-dir", str(cache), cache=cache,
                   stdin=script)  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    text = r.stdout.decode()
    assert "a.txt:" in text and "earlier.spark:" in text and "nothing to read" in text


def test_hostile_attachments_are_one_sentence(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    pdf = tmp_path / "locked.pdf"
    pdf.write_bytes(encrypted_pdf())
    for bad, words in ((pdf, "encrypted PDF"), (tmp_path / "missing.txt", "does not exist")):
        r = engine_cli("generate", "--model", str(model), "--prompt", "x", "--attach", str(bad), cache=tmp_path)
        err = r.stderr.decode()
        assert r.returncode != 0 and words in err and "Traceback" not in err


def test_a_saved_conversation_with_a_document_continues_as_one_run(tmp_path: Path) -> None:
    """N tokens with --attach, saved; loaded and continued M tokens == N+M in one run; `read_tokens` counts only
    what this run computed; a cache without the document says so in one sentence until the user attaches it."""
    model = make_tiny_model(tmp_path / "tiny")
    doc = tmp_path / "notes.md"
    doc.write_text("\n".join(f"Note {i}: the quick brown fox." for i in range(60)))
    cache = tmp_path / "cache"
    common = ["generate", "--model", str(model), "--greedy", "--json", "--cache-dir", str(cache)]
    ask = ["--prompt", "The quick", "--attach", str(doc)]
    whole = json.loads(engine_cli(*common, *ask, "--max-tokens", "8", cache=cache).stdout)
    saved = tmp_path / "s.spark"
    first = engine_cli(*common, *ask, "--max-tokens", "4", "--save-session", str(saved), cache=cache)
    assert first.returncode == 0, first.stderr.decode()
    out = json.loads(first.stdout)
    assert out["read_tokens"] == out["prompt_tokens"] + 3  # the capsule was found: only the prompt and reply ran
    assert str(doc.parent) not in saved.read_bytes().decode("latin-1")  # the file names the document, not its path
    more = engine_cli(*common, "--load-session", str(saved), "--continue", "--max-tokens", "4", cache=cache)
    assert more.returncode == 0, more.stderr.decode()
    cont = json.loads(more.stdout)
    assert out["tokens"] + cont["tokens"] == whole["tokens"]
    assert cont["read_tokens"] == 4 and cont["document_tokens"] == out["document_tokens"]
    other = tmp_path / "other-cache"
    gone = engine_cli("generate", "--model", str(model), "--cache-dir", str(other), "--load-session", str(saved),
                      "--continue", "--max-tokens", "4", cache=other)  # fmt: skip
    err = gone.stderr.decode()
    assert gone.returncode != 0 and "notes.md" in err and "attach it again" in err and "Traceback" not in err
    back = engine_cli("generate", "--model", str(model), "--cache-dir", str(other), "--load-session", str(saved),
                      "--continue", "--max-tokens", "4", "--greedy", "--json", "--attach", str(doc), cache=other)  # fmt: skip
    assert back.returncode == 0, back.stderr.decode()
    assert json.loads(back.stdout)["tokens"] == cont["tokens"]


def test_chat_saves_and_loads_a_conversation_with_its_attachment(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    doc = tmp_path / "notes.md"
    doc.write_text("\n".join(f"Note {i}: the quick brown fox." for i in range(60)))
    saved = tmp_path / "c.spark"
    cache = tmp_path / "cache"

    def chat(script: str, cache: Path) -> tuple[str, str]:
        r = engine_cli("chat", "--model", str(model), "--max-tokens", "3", "--cache-dir", str(cache), cache=cache,
                       stdin=script.encode())  # fmt: skip
        assert r.returncode == 0, r.stderr.decode()
        return r.stdout.decode(), r.stderr.decode()

    out, _ = chat(f"/attach {doc}\nquick\n/save {saved}\n/load {saved}\nquick\n/quit\n", cache)
    assert "Restored" in out
    other = tmp_path / "other"
    out, err = chat(f"/load {saved}\n/quit\n", other)
    assert "Restored" not in out and "notes.md" in err and "attach it again" in err
    out, _ = chat(f"/attach {doc}\n/load {saved}\nquick\n/quit\n", other)
    assert "Restored" in out
