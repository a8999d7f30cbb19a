"""A conversation about pictures in a `.spark` file: full and compact files restore and continue exactly as never
having stopped, each picture is stored once by its hash, and a file whose pictures are absurd, damaged or not the
ones its tokens stand for is refused in one sentence with nothing restored."""

from __future__ import annotations

import dataclasses
import hashlib
import io
from pathlib import Path

import pytest
from PIL import Image

from engine.errors import SessionFileError
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.session.engine import Engine, Session, load
from engine.session.file import load_session
from engine.vision.images import DecodedImage
from engine.vision.model import ImageEmbedding
from tests.helpers.pictures import picture
from tests.helpers.tiny_idefics3 import make_tiny_idefics3

pytest.importorskip("transformers")
GREEDY = GenerationSettings(max_tokens=6, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


def reply(session: Session, text: str, images: list[DecodedImage] = []) -> list[int]:  # noqa: B006 (never mutated)
    return [e.token for e in session.chat(text, GREEDY, images=images) if e.token is not None]


def frames_encoded(engine: Engine) -> int:
    assert engine.vision is not None and isinstance(engine.vision.embedding, ImageEmbedding)
    return engine.vision.embedding.encoded_frames


def conversation(engine: Engine) -> Session:
    """Two turns about one picture (shown twice) and a third about another."""
    session = engine.new_session()
    pic, other = picture(40, 24, 11), picture(20, 30, 12)
    reply(session, "What is it?", [pic])
    reply(session, "Look again:", [pic])
    reply(session, "And this one?", [other])
    return session


@pytest.mark.parametrize("compact", [False, True])
def test_restore_and_continue_exactly(folder: Path, tmp_path: Path, compact: bool) -> None:
    engine = load(folder, "cpu", prefix_cache=False)
    session = conversation(engine)
    path = tmp_path / "pictures.spark"
    session.save(path, compact=compact)
    before = session.computed.count
    expected = reply(session, "Which was first?")
    computed = session.computed.count - before

    data = load_session(path)
    assert data.extra["images"] == [img.sha256 for img in session.images[:3]]
    assert len(set(data.extra["images"])) == 2 and len(data.images) == 3  # shown twice, stored once
    assert not any(n.startswith("image.") for n in data.tensors)  # the memory's tensors only

    fresh = load(folder, "cpu", prefix_cache=False)  # another engine: nothing of the pictures held
    restored = fresh.new_session()
    report = restored.load(path)
    assert report.applied and [img.sha256 for img in restored.images] == data.extra["images"]
    assert restored.memory_source == ("recomputed" if compact else "file")
    before = restored.computed.count
    assert reply(restored, "Which was first?") == expected
    assert restored.computed.count - before == computed  # what continuing computes, as if never stopped


@pytest.mark.parametrize("compact", [False, True])
def test_a_full_file_holds_the_pictures_memory(folder: Path, tmp_path: Path, compact: bool) -> None:
    engine = load(folder, "cpu", prefix_cache=False)
    session = engine.new_session()
    settings = GenerationSettings(max_tokens=6, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))
    list(session.complete("Two pictures: <image> and <image>.", settings, images=[picture(40, 24, 17)] * 2))
    path = tmp_path / "completion.spark"
    session.save(path, compact=compact)
    expected = [e.token for e in session.complete(" So?", settings) if e.token is not None]

    fresh = load(folder, "cpu", prefix_cache=False)
    restored = fresh.new_session()
    assert restored.load(path).applied
    assert [e.token for e in restored.complete(" So?", settings) if e.token is not None] == expected
    # Full: the memory holds the picture's keys and values, so nothing of it is encoded again. Compact: the replay
    # encodes it once (shown twice, stored and encoded once).
    assert frames_encoded(fresh) == (frames_encoded(engine) if compact else 0) == (5 if compact else 0)


def test_a_new_question_after_a_restore_may_show_a_picture_again(folder: Path, tmp_path: Path) -> None:
    engine = load(folder, "cpu", prefix_cache=False)
    session = conversation(engine)
    path = tmp_path / "again.spark"
    session.save(path, compact=True)
    expected = reply(session, "Compare:", [picture(40, 24, 11)])
    restored = load(folder, "cpu", prefix_cache=False).new_session()
    assert restored.load(path).applied
    assert reply(restored, "Compare:", [picture(40, 24, 11)]) == expected


def png_bytes(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


def forged(like: DecodedImage, data: bytes) -> DecodedImage:
    return dataclasses.replace(like, sha256=hashlib.sha256(data).hexdigest(), data=data)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (png_bytes(20000, 1), "is 20000x1 pixels; the engine accepts at most 16384 a side"),
        (png_bytes(30, 30)[:60], "is truncated or damaged"),
        (b"GIF89a" + b"\0" * 40, "is not a PNG, JPEG, WebP or GIF picture"),
    ],
)
def test_a_file_naming_an_absurd_picture_is_refused(folder: Path, tmp_path: Path, data: bytes, says: str) -> None:
    engine = load(folder, "cpu", prefix_cache=False)
    session = engine.new_session()
    reply(session, "What is it?", [picture(40, 24, 13)])
    session.images[0] = forged(session.images[0], data)
    path = tmp_path / "absurd.spark"
    session.save(path, compact=True)
    with pytest.raises(SessionFileError, match=f"absurd.spark holds a picture that cannot be used.*{says}"):
        load_session(path)
    target = load(folder, "cpu", prefix_cache=False).new_session()
    with pytest.raises(SessionFileError, match="nothing was restored"):
        target.load(path)
    assert target.messages == [] and target.images == [] and not target.memory.tokens


@pytest.mark.parametrize("compact", [False, True])
def test_a_picture_its_tokens_do_not_stand_for_is_refused(folder: Path, tmp_path: Path, compact: bool) -> None:
    engine = load(folder, "cpu", prefix_cache=False)
    session = engine.new_session()
    reply(session, "What is it?", [picture(40, 24, 14)])
    session.images[0] = picture(40, 24, 15)  # a sound picture, but not the one read
    path = tmp_path / "swapped.spark"
    session.save(path, compact=compact)
    target = load(folder, "cpu", prefix_cache=False).new_session()
    with pytest.raises(SessionFileError, match="picture tokens that none of its pictures gives"):
        target.load(path)
    assert target.messages == [] and not target.memory.tokens


def test_a_text_model_refuses_a_file_with_pictures(folder: Path, tmp_path: Path) -> None:
    from tests.helpers.tiny import make_tiny_model

    engine = load(folder, "cpu", prefix_cache=False)
    session = engine.new_session()
    reply(session, "What is it?", [picture(40, 24, 16)])
    path = tmp_path / "seen.spark"
    session.save(path)
    text = load(make_tiny_model(tmp_path / "text"), "cpu", prefix_cache=False).new_session()
    report = text.load(path)  # another model's file: the transcript only, when asked for
    assert not report.applied and text.images == []


def test_session_verify_and_inspect_a_file_with_pictures(folder: Path, tmp_path: Path) -> None:
    from tests.helpers.engine_cli import engine_cli

    engine = load(folder, "cpu", prefix_cache=False)
    session = conversation(engine)
    for compact in (False, True):
        path = tmp_path / f"cli-{compact}.spark"
        session.save(path, compact=compact)
        r = engine_cli("session", "verify", str(path), "--model", str(folder), cache=tmp_path / "cache")
        assert r.returncode == 0 and "restores on this model" in r.stdout, r.stderr
        r = engine_cli("session", "inspect", str(path), "--json", cache=tmp_path / "cache")
        assert r.returncode == 0, r.stderr
        assert '"image"' in r.stdout  # the pictures' bytes, reported beside the memory's tiers


def test_more_pictures_than_a_file_holds_are_refused_when_saving(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.session import pictures

    session = load(folder, "cpu", prefix_cache=False).new_session()
    reply(session, "What is it?", [picture(40, 24, 18), picture(40, 24, 19)])
    monkeypatch.setattr(pictures, "MAX_SESSION_IMAGES", 1)
    with pytest.raises(SessionFileError, match="shows 2 pictures, more than the 1 a file holds"):
        session.save(tmp_path / "many.spark")
    monkeypatch.setattr(pictures, "MAX_SESSION_IMAGES", 256)
    monkeypatch.setattr(pictures, "MAX_SESSION_IMAGE_BYTES", 100)
    with pytest.raises(SessionFileError, match="more than the 0 MB a file holds"):
        session.save(tmp_path / "many.spark")
    assert not (tmp_path / "many.spark").exists()


def test_generate_image_save_load_continue(folder: Path, tmp_path: Path) -> None:
    """N tokens about a picture, saved, loaded and continued M tokens, equal N+M in one run (the CLI's contract)."""
    import json

    from tests.helpers.engine_cli import engine_cli
    from tests.helpers.pictures import png

    (tmp_path / "a.png").write_bytes(png(40, 24, 20))
    common = ["generate", "--model", str(folder), "--backend", "cpu", "--no-prefix-cache", "--chat", "--greedy"]
    common += ["--json", "--image", str(tmp_path / "a.png"), "--prompt", "What?"]
    cache = tmp_path / "cache"
    whole = engine_cli(*common, "--max-tokens", "10", cache=cache)
    assert whole.returncode == 0, whole.stderr
    first = engine_cli(*common, "--max-tokens", "4", "--save-session", str(tmp_path / "s.spark"), cache=cache)
    assert first.returncode == 0, first.stderr
    rest = engine_cli(
        "generate",
        "--model",
        str(folder),
        "--backend",
        "cpu",
        "--no-prefix-cache",
        "--greedy",
        "--json",
        "--load-session",
        str(tmp_path / "s.spark"),
        "--continue",
        "--max-tokens",
        "6",
        cache=cache,
    )
    assert rest.returncode == 0, rest.stderr
    assert json.loads(first.stdout)["tokens"] + json.loads(rest.stdout)["tokens"] == json.loads(whole.stdout)["tokens"]
