"""A conversation about pictures with Gemma 3 in a `.spark` file, read in chunks smaller than a picture: full and
compact files restore and continue exactly as never having stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.session.engine import Session, load
from engine.vision.images import DecodedImage
from tests.helpers.pictures import picture
from tests.helpers.tiny_gemma3 import make_tiny_gemma3

pytest.importorskip("transformers")
GREEDY = GenerationSettings(max_tokens=6, ignore_eos=True, prefill_chunk=3, sampling=SamplingSettings(temperature=0.0))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


def reply(session: Session, text: str, images: list[DecodedImage] = []) -> list[int]:  # noqa: B006 (never mutated)
    return [e.token for e in session.chat(text, GREEDY, images=images) if e.token is not None]


@pytest.mark.parametrize("compact", [False, True])
def test_restore_and_continue_exactly(folder: Path, tmp_path: Path, compact: bool) -> None:
    engine = load(folder, "cpu", prefix_cache=False)
    session = engine.new_session()
    reply(session, "What is it?", [picture(40, 24, 11)])
    reply(session, "And this one?", [picture(20, 30, 12)])
    path = tmp_path / "pictures.spark"
    session.save(path, compact=compact)
    before = session.computed.count
    expected = reply(session, "Which was first?")
    computed = session.computed.count - before

    restored = load(folder, "cpu", prefix_cache=False).new_session()  # another engine: nothing of the pictures held
    assert restored.load(path).applied
    assert restored.memory_source == ("recomputed" if compact else "file")
    before = restored.computed.count
    assert reply(restored, "Which was first?") == expected
    assert restored.computed.count - before == computed
