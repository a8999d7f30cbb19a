"""A real picture (the tiny SmolVLM checkpoint's) is a unit in the memory cascade: through a conversation that runs
until it leaves a small window, after every forward its tokens are all in the window or all out; once evicted, a
routing decision that brings any of it back brings all of it, in every layer; and the conversation saved full or
compact, or kept on disk, restores bit-identically and continues exactly. A picture of more blocks than a text
model's retrieval groups (SmolVLM's tiles, Gemma 3's frame, Qwen2.5-VL's longest grid) comes back whole too, in
the room its model's largest picture reserved (`max_picture_tokens`, a GGUF projector's the folder's); a text
model's geometry is unchanged. (That a second question about the same picture reads none of its tokens again is
test_vision_session's.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.backends.torch_backend import TorchBackend
from engine.bench.mmproj_export import export_vision
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.memory.base import RowPlan
from engine.memory.cascade import CascadeConfig, CascadeMemory
from engine.session.engine import Engine, Session, memory_factory_for
from engine.session.kept import KeptMemory
from engine.session.replay import memory_digest
from engine.vision.images import DecodedImage
from engine.vision.qwen25vl import Qwen25VLPreprocessing
from tests.helpers.pictures import picture
from tests.helpers.tiny import make_tiny_model
from tests.helpers.tiny_gemma3 import make_tiny_gemma3
from tests.helpers.tiny_idefics3 import make_tiny_idefics3
from tests.helpers.tiny_qwen25vl import make_tiny_qwen25vl

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
    many of the picture's blocks the retrieval groups hold and how many of its tokens they hold."""

    def __init__(self, memory: CascadeMemory) -> None:
        self.memory = memory
        self.held: list[int] = []
        self.recalled: list[list[int]] = []
        self.back: list[list[int]] = []  # per layer, how many of its tokens the blocks in the groups hold
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
        b, sinks = m.cfg.block_size, m.cfg.sink_tokens
        self.back.append(
            [
                len({t for g in layer for t in range(sinks + b * g, sinks + b * (g + 1))} & set(range(s, e)))
                for layer in w.groups
            ]
        )


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


# -- a picture larger than the retrieval groups a text model gets ------------------------------------------------

# Per family: the geometry asked for (a small window, no retrieval gate, fewer groups than the picture's blocks,
# so that only the reserved room brings it back whole) and the largest picture its processor makes (its size).
LARGE = {
    # a 2 x 2 tiling and the global view: 31 tokens from the first image token to the last, 11+ blocks of 3
    "idefics3": ({"window": 64, "block_size": 3, "gate_rank": 0, "reroute_every": 4}, (64, 64)),
    # one frame of 4 tokens (the tiny checkpoint's), 2+ blocks of 3 against 1 group
    "gemma3": ({"window": 32, "block_size": 3, "retrieval_blocks": 1, "gate_rank": 0, "reroute_every": 4}, (40, 24)),
    # 1 x 154 merged tokens (its most elongated picture shrunk into max_pixels): 20 blocks of 8
    "qwen25vl": ({"window": 160, "block_size": 8, "gate_rank": 0, "reroute_every": 4}, (4, 800)),
}
MORE = [f"Question {i}: what else is in the picture, its colours and its shapes, left to right?" for i in range(12)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, folder: Path) -> dict[str, Path]:
    return {
        "idefics3": folder,
        "gemma3": make_tiny_gemma3(tmp_path_factory.mktemp("gemma3")),
        "qwen25vl": make_tiny_qwen25vl(tmp_path_factory.mktemp("qwen25vl")),
    }


def large_engine(folders: dict[str, Path], family: str, cache: Path) -> Engine:
    geometry, _ = LARGE[family]
    return Engine.load(
        folders[family], "cpu", memory_factory=memory_factory_for(folders[family], cache_dir=cache, **geometry)
    )


@pytest.mark.parametrize("family", LARGE)
def test_max_picture_tokens_is_the_largest_pictures_expansion(
    folders: dict[str, Path], family: str, tmp_path: Path
) -> None:
    """Derived from the processor's settings: the largest picture's expansion, wrappers included, and no picture's
    more."""
    vision = large_engine(folders, family, tmp_path).vision
    assert vision is not None
    _, largest = LARGE[family]
    assert len(vision.encode_prompt("<image>", [picture(*largest, 1)], add_bos=False)) == vision.max_picture_tokens
    for w, h in [(40, 24), (24, 40), (8, 8), (300, 200)]:
        assert len(vision.encode_prompt("<image>", [picture(w, h, 2)], add_bos=False)) <= vision.max_picture_tokens


@pytest.mark.parametrize("family", LARGE)
def test_a_large_picture_leaves_whole_and_comes_back_whole(
    folders: dict[str, Path], family: str, tmp_path: Path
) -> None:
    geometry, largest = LARGE[family]
    eng = large_engine(folders, family, tmp_path / "cache")
    assert eng.vision is not None
    session = eng.new_session()
    memory = session.memory
    assert isinstance(memory, CascadeMemory)
    block = geometry["block_size"]
    asked = geometry.get("retrieval_blocks", 8)
    # The geometry reserved: groups for the largest picture's blocks and one more; the window as asked (the
    # 512-token context holds both).
    assert memory.cfg.retrieval_blocks == -(-eng.vision.max_picture_tokens // block) + 1 > asked
    assert memory.cfg.window == geometry["window"]
    watch = Watch(memory)
    reply(session, "Look at this picture.", [picture(*largest, 3)])
    (span,) = memory.pictures.spans
    size = span[1] - span[0]
    blocks = memory.pictures.blocks(memory.cfg.sink_tokens, block)[0]
    assert len(blocks) > asked  # more than the groups a text model would get
    for question in MORE:
        reply(session, question)
        if memory.working.evicted >= span[1] and any(any(r) for r in watch.recalled[-4:]):
            break
    assert set(watch.held) == {0, size} and watch.held[-1] == 0  # after every forward: all of it, or none
    assert set(blocks) <= set(memory.episodic.blocks)
    recalls = [r for r in watch.recalled if any(r)]
    assert recalls and all(r == [len(blocks)] * len(r) for r in recalls)  # every time whole, in every layer
    # Count its tokens back, each time: every token of its span is in a block a group holds, in every layer.
    assert all(t == [size] * len(t) for t, r in zip(watch.back, watch.recalled, strict=True) if any(r))

    # Saved full and compact, it restores bit-identically and goes on exactly.
    digest = memory_digest(memory)
    paths = {compact: tmp_path / f"picture-{compact}.spark" for compact in (False, True)}
    for compact, path in paths.items():
        session.save(path, compact=compact)
    expected = reply(session, MORE[-1])
    for path in paths.values():
        restored = large_engine(folders, family, tmp_path / "cache").new_session()
        assert restored.load(path).applied
        assert memory_digest(restored.memory) == digest
        assert isinstance(restored.memory, CascadeMemory) and restored.memory.pictures.spans == [span]
        assert reply(restored, MORE[-1]) == expected


def test_a_text_models_geometry_is_unchanged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = make_tiny_model(tmp_path / "text", max_positions=512)
    factory = memory_factory_for(model, cache_dir=tmp_path / "cache", block_size=8)
    eng = Engine.load(model, "cpu", memory_factory=factory)
    assert eng.vision is None and eng.memory_factory is factory and factory.picture_tokens == 0
    memory = eng.new_session().memory
    assert isinstance(memory, CascadeMemory)
    assert memory.cfg == CascadeConfig.for_model(model, eng.choice.backend.config, block_size=8)
    assert memory.cfg.retrieval_blocks == 8 and memory.cfg.window == 512 - 4 - 64
    # Room a context cannot make (51 groups and a window of the picture's 400 tokens in 512 positions): the text
    # geometry, and one sentence saying so, once.
    wide = factory.for_pictures(400)
    with caplog.at_level(logging.WARNING, logger="engine.session.setup"):
        first, second = wide(TorchBackend(model)), wide(TorchBackend(model))
    assert isinstance(first, CascadeMemory) and isinstance(second, CascadeMemory)
    assert first.cfg == second.cfg == memory.cfg
    (said,) = [r.getMessage() for r in caplog.records if r.name == "engine.session.setup"]
    assert "400 tokens" in said and "block by block" in said


def test_a_gguf_and_its_projector_reserve_the_same_room(folders: dict[str, Path], tmp_path: Path) -> None:
    """The projector's VisionModel answers max_picture_tokens from the same preprocessing, so its memory's
    geometry is the folder's."""
    gguf, _ = export_vision(folders["idefics3"], tmp_path / "gguf", "f32", "f32")
    geometry, _ = LARGE["idefics3"]
    of_folder = large_engine(folders, "idefics3", tmp_path / "cache")
    of_gguf = Engine.load(gguf, "cpu", memory_factory=memory_factory_for(gguf, cache_dir=tmp_path / "c2", **geometry))
    assert of_gguf.mmproj is not None and of_gguf.vision is not None and of_folder.vision is not None
    assert of_gguf.vision.max_picture_tokens == of_folder.vision.max_picture_tokens
    mine, theirs = of_gguf.new_session().memory, of_folder.new_session().memory
    assert isinstance(mine, CascadeMemory) and isinstance(theirs, CascadeMemory)
    assert mine.cfg == theirs.cfg and mine.cfg.retrieval_blocks > 8


def test_the_largest_picture_is_counted_not_written() -> None:
    """A folder's settings may ask for millions of tokens a picture: the count costs no allocation of that size."""
    huge = Qwen25VLPreprocessing(patch=1, merge=1, temporal=1, min_pixels=1, max_pixels=4096 * 4096)
    text, more = huge.largest_picture()
    assert len(text) < 64 and more == 4096 * 4096 - 1
