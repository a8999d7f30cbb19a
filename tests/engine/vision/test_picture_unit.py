"""A real picture (the tiny SmolVLM checkpoint's) is a unit in the memory cascade: through a conversation that runs
until it leaves a small window, after every forward its tokens are all in the window or all out; once evicted, a
routing decision that brings any of it back brings all of it, in every layer; and the conversation saved full or
compact, or kept on disk, restores bit-identically and continues exactly. (That a second question about the same
picture reads none of its tokens again is test_vision_session's.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.memory.base import RowPlan
from engine.memory.cascade import CascadeMemory
from engine.session.engine import Engine, Session, memory_factory_for
from engine.session.kept import KeptMemory
from engine.session.replay import memory_digest
from engine.vision.images import DecodedImage
from tests.helpers.pictures import picture
from tests.helpers.tiny_idefics3 import make_tiny_idefics3

pytest.importorskip("transformers")
GREEDY = GenerationSettings(max_tokens=8, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))
# A 64-token window of 8-token blocks, 6 retrieval groups (the picture's blocks fit them), no retrieval gate (every
# routing decision fills the groups, so the picture's blocks are among the candidates each time).
GEOMETRY = {"window": 64, "block_size": 8, "retrieval_blocks": 6, "gate_rank": 0, "reroute_every": 4}
QUESTIONS = ["What is it?", "Tell me more about the colours.", "And the shapes in it?", "Anything else to see?"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


def engine(folder: Path, cache: Path) -> Engine:
    return Engine.load(folder, "cpu", memory_factory=memory_factory_for(folder, cache_dir=cache, **GEOMETRY))


def reply(session: Session, text: str, images: list[DecodedImage] = []) -> list[int]:  # noqa: B006 (never mutated)
    return [e.token for e in session.chat(text, GREEDY, images=images) if e.token is not None]


class Watch:
    """After every plan of `memory`: how many of its first picture's tokens the window holds, and, per layer, how
    many of the picture's blocks the retrieval groups hold."""

    def __init__(self, memory: CascadeMemory) -> None:
        self.memory = memory
        self.held: list[int] = []
        self.recalled: list[list[int]] = []
        plan = memory.plan

        def watched(ids: list[int]) -> RowPlan:
            out = plan(ids)
            self.look()
            return out

        memory.plan = watched  # type: ignore[method-assign]

    def look(self) -> None:
        m = self.memory
        if not m.pictures.spans:
            return
        s, e = m.pictures.spans[0]
        w = m.working
        first = w.n_sink + w.evicted
        self.held.append(sum(first <= i < first + w.n_window for i in range(s, e)))
        blocks = set(m.pictures.blocks(m.cfg.sink_tokens, m.cfg.block_size)[0])
        self.recalled.append([len(blocks & set(layer)) for layer in w.groups])


def test_a_picture_stays_whole_through_a_long_conversation(folder: Path, tmp_path: Path) -> None:
    eng = engine(folder, tmp_path / "cache")
    assert eng.vision is not None
    session = eng.new_session()
    memory = session.memory
    assert isinstance(memory, CascadeMemory)
    watch = Watch(memory)
    reply(session, "Look at this picture.", [picture(40, 24, 3)])
    (span,) = memory.pictures.spans
    size = span[1] - span[0]
    pictured = [t for t in memory.tokens[span[0] : span[1]] if t >= eng.vision.vocab_size]
    assert len(pictured) == 5 * 4  # a 2 x 2 tiling and the global view, 4 tokens a frame
    for question in QUESTIONS:
        reply(session, question)
    assert set(watch.held) == {0, size}  # after every forward: all of it in the window, or none
    assert watch.held[0] == size and watch.held[-1] == 0
    blocks = memory.pictures.blocks(memory.cfg.sink_tokens, memory.cfg.block_size)[0]
    assert set(blocks) <= set(memory.episodic.blocks)  # it left as complete blocks
    # Routing brought it back at least once, and every time whole: all its blocks in every layer's groups.
    recalls = [r for r in watch.recalled if any(r)]
    assert recalls and all(r == [len(blocks)] * len(r) for r in recalls)
    tokens_back = sum(1 for b in blocks for i in range(8) if span[0] <= 4 + 8 * b + i < span[1])
    assert tokens_back == size


@pytest.mark.parametrize("compact", [False, True])
def test_a_conversation_whose_picture_left_restores_exactly(folder: Path, tmp_path: Path, compact: bool) -> None:
    eng = engine(folder, tmp_path / "cache")
    session = eng.new_session()
    reply(session, "Look at this picture.", [picture(40, 24, 3)])
    for question in QUESTIONS[:3]:
        reply(session, question)
    memory = session.memory
    assert isinstance(memory, CascadeMemory) and memory.pictures.spans
    assert memory.working.evicted >= memory.pictures.spans[0][1]  # the picture has left the window
    path = tmp_path / "picture.spark"
    session.save(path, compact=compact)
    digest = memory_digest(session.memory)
    expected = reply(session, QUESTIONS[3])

    restored = engine(folder, tmp_path / "cache").new_session()  # the same machine: its prefix cache too
    assert restored.load(path).applied
    assert memory_digest(restored.memory) == digest
    assert isinstance(restored.memory, CascadeMemory) and restored.memory.pictures.spans == memory.pictures.spans
    assert reply(restored, QUESTIONS[3]) == expected


def test_a_kept_memory_with_a_picture_reopens_and_goes_on_as_never_left(folder: Path, tmp_path: Path) -> None:
    eng = engine(folder, tmp_path / "cache")
    session = eng.new_session()
    reply(session, "Look at this picture.", [picture(40, 24, 3)])
    for question in QUESTIONS[:3]:
        reply(session, question)
    record = tmp_path / "picture.spark"
    session.save(record, compact=True)
    kept = KeptMemory(tmp_path / "kept")
    assert session.keep(kept, record)
    reopened = eng.new_session()
    reopened.load(record, kept=kept)
    assert reopened.memory_source == "kept" and reopened.computed.count == 0
    memory = session.memory
    assert isinstance(memory, CascadeMemory) and isinstance(reopened.memory, CascadeMemory)
    assert reopened.memory.pictures.spans == memory.pictures.spans
    assert reply(reopened, QUESTIONS[3]) == reply(session, QUESTIONS[3])
