"""A picture is a unit in the cascade: its span is wholly in the window or wholly out at every step, it leaves as
whole episodic blocks, routing that picks one of its blocks brings all of them back in every layer, a taken-back
plan puts it back exactly, and its state restores and continues exactly; a geometry fitted with room for a
picture of more blocks than the groups brings it back whole beside text routing's picks. The pictures here are
stand-in ids a `PictureTokens` names (the cascade never sees pixels); tests/engine/vision/test_picture_unit.py runs
real ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.errors import SessionFileError
from engine.generation.loop import PromptFeed
from engine.memory.cascade import CascadeConfig, CascadeMemory, PersistentStore
from engine.memory.cascade.pictures import PictureSpans
from tests.engine.memory.cascade.helpers import feed, greedy, random_ids

CFG = CascadeConfig(sink_tokens=4, window=48, block_size=8, retrieval_blocks=4, reroute_every=4)
FIRST = 200  # stand-in picture ids: FIRST + index, for a picture of COUNT tokens
COUNT = 20
TEXT_VOCAB = 200


def picture_token(token: int) -> tuple[int, int] | None:
    return (token - FIRST, COUNT) if FIRST <= token < FIRST + COUNT else None


def picture(between: list[int]) -> list[int]:
    """A picture's ids with text tokens between its halves (as a processor's tile markers are)."""
    return [*range(FIRST, FIRST + COUNT // 2), *between, *range(FIRST + COUNT // 2, FIRST + COUNT)]


def memory(model: Path, store: Path | None = None, cfg: CascadeConfig = CFG) -> tuple[TorchBackend, CascadeMemory]:
    b = TorchBackend(model)
    s = PersistentStore(store, b.fingerprint, b.numerics) if store is not None else None
    return b, CascadeMemory(b, cfg, store=s, pictures=picture_token)


def prompt(b: TorchBackend, m: CascadeMemory, ids: list[int], chunk: int) -> torch.Tensor:
    """Feed a prompt in chunks ending where the memory asks (as engine.generation.loop.prefill does)."""
    feeder = PromptFeed(ids, 0, m.prefill_cut(ids, 0))
    logits = None
    while not feeder.done:
        logits = feed(b, m, feeder.next(chunk))
    assert logits is not None
    return logits[-1]


def window_range(m: CascadeMemory) -> range:
    """The conversation's token indices the window holds."""
    w = m.working
    first = w.n_sink + w.evicted
    return range(first, first + w.n_window)


def in_window(m: CascadeMemory, span: tuple[int, int]) -> int:
    held = window_range(m)
    return sum(i in held for i in range(*span))


def test_spans_are_read_from_indices_in_order() -> None:
    spans = PictureSpans(picture_token)
    spans.feed([1, *picture([7, 8]), 3, *range(FIRST, FIRST + 5), 9, FIRST + 7], 10)
    assert spans.spans == [(11, 11 + COUNT + 2)] and spans.open is None  # a run out of order is no picture
    spans.feed([*range(FIRST, FIRST + 5)], 100)
    assert spans.open == (100, 5, COUNT)
    spans.truncate([0] * 100 + [*range(FIRST, FIRST + 5)], 103)
    assert spans.open == (100, 3, COUNT)
    assert spans.cut(12) == (11, 33) and spans.cut(11) is None and spans.cut(33) is None
    assert spans.blocks(4, 8) == [range(0, 4)]


@pytest.mark.parametrize("chunk", [16, 40, 48])
def test_a_picture_is_wholly_in_the_window_or_wholly_out(tiny_model: Path, chunk: int) -> None:
    b, m = memory(tiny_model)
    ids = random_ids(30, seed=1, vocab=TEXT_VOCAB) + picture([5, 6]) + random_ids(70, seed=2, vocab=TEXT_VOCAB)
    span = (30, 30 + COUNT + 2)
    feeder = PromptFeed(ids, 0, m.prefill_cut(ids, 0))
    seen_in, left_at = False, None
    for step in range(200):
        if not feeder.done:
            logits = feed(b, m, feeder.next(chunk))[-1]
        elif len(m.tokens) < 200:
            logits = feed(b, m, [int(logits.argmax()) % TEXT_VOCAB])[-1]
        else:
            break
        if len(m.tokens) < span[1]:
            continue
        held = in_window(m, span)
        assert held in (0, span[1] - span[0]), f"step {step}: {held} of the picture's tokens in the window"
        seen_in |= held > 0
        if held == 0 and left_at is None:
            left_at = step
    assert m.pictures.spans == [span] and seen_in and left_at is not None
    # It left as whole blocks: every block its span touches is complete in episodic memory.
    blocks = m.pictures.blocks(CFG.sink_tokens, CFG.block_size)[0]
    assert set(blocks) <= set(m.episodic.blocks)
    assert m.working.evicted >= span[1]


def test_a_text_conversation_never_releases(tiny_model: Path) -> None:
    """Without pictures the window stays full once it has filled (the memory evicts exactly as it always did)."""
    b, m = memory(tiny_model)
    logits = prompt(b, m, random_ids(90, seed=3, vocab=TEXT_VOCAB), 16)
    for _ in range(20):
        logits = feed(b, m, [int(logits.argmax()) % TEXT_VOCAB])[-1]
        assert m.working.n_window == CFG.window
    assert "pictures" not in m.state()[0]


def test_routing_that_picks_one_block_recalls_the_whole_picture(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b, m = memory(tiny_model)
    ids = random_ids(30, seed=1, vocab=TEXT_VOCAB) + picture([5, 6]) + random_ids(80, seed=2, vocab=TEXT_VOCAB)
    prompt(b, m, ids, 16)
    blocks = list(m.pictures.blocks(CFG.sink_tokens, CFG.block_size)[0])
    assert in_window(m, (30, 52)) == 0 and set(blocks) <= set(m.episodic.blocks)
    text_block = next(i for i in m.episodic.blocks if i not in blocks)
    layers = m.working.num_layers
    # One layer picks one of the picture's blocks, the others a text block; the gate admits one group.
    picks = [[blocks[1]]] + [[text_block]] * (layers - 1)
    monkeypatch.setattr(m.episodic, "select", lambda *a, **k: [list(p) for p in picks])
    m.retriever.route(prefill=True, answering=False)
    for layer in m.working.groups:
        assert blocks == sorted(set(layer) & set(blocks))  # every block of it, in every layer
    # Its tokens are all back: the groups holding its blocks hold exactly those blocks' KV.
    kv = {i: m.episodic.blocks[i].k for i in blocks}
    for g, bid in enumerate(m.working.groups[0]):
        if bid in kv:
            k, _ = b.read_kv(0, m.working.group_slots(g))
            assert torch.equal(k, kv[bid])
    covered = sum(len(range(*span)) for span in m.pictures.spans)
    held = {t for bid in blocks for t in range(4 + bid * 8, 4 + (bid + 1) * 8)}
    assert all(t in held for t in range(30, 52)) and covered == 22


def test_rolling_back_a_plan_that_released_a_picture_puts_it_back(tiny_model: Path) -> None:
    b, m = memory(tiny_model)
    ids = random_ids(30, seed=1, vocab=TEXT_VOCAB) + picture([5, 6]) + random_ids(26, seed=2, vocab=TEXT_VOCAB)
    prompt(b, m, ids, 16)
    before_state = json.dumps(m.working.state())
    before_kv = b.read_kv(0, torch.arange(CFG.num_slots))
    valid, positions = m.working.valid.clone(), m.working.slot_positions.clone()
    assert in_window(m, (30, 52)) == 22
    m.plan(random_ids(6, seed=9, vocab=TEXT_VOCAB))  # pushes the window's edge into the picture: it leaves whole
    assert in_window(m, (30, 52)) == 0 and m._released > 0
    m.rollback(6)  # a forward stopped before it was done
    assert json.dumps(m.working.state()) == before_state
    assert torch.equal(m.working.valid, valid) and torch.equal(m.working.slot_positions, positions)
    after_kv = b.read_kv(0, torch.arange(CFG.num_slots))
    assert all(torch.equal(x[:, :, valid], y[:, :, valid]) for x, y in zip(before_kv, after_kv, strict=True))
    assert m.pictures.spans == [(30, 52)] and len(m.tokens) == len(ids)


@pytest.mark.parametrize("at", [20, 60])
def test_a_state_with_pictures_restores_and_continues_exactly(tiny_model: Path, tmp_path: Path, at: int) -> None:
    """`at`: greedy steps before saving (20: the picture still in the window; 60: it has left)."""
    ids = random_ids(30, seed=1, vocab=TEXT_VOCAB) + picture([5, 6]) + random_ids(10, seed=2, vocab=TEXT_VOCAB)
    b1, m1 = memory(tiny_model, tmp_path / "a")
    want, _ = greedy(b1, m1, prompt(b1, m1, ids, 16), at + 30)
    b2, m2 = memory(tiny_model, tmp_path / "b")
    first, logits = greedy(b2, m2, prompt(b2, m2, ids, 16), at)
    meta, tensors = m2.state()
    assert meta["pictures"] == {"spans": [[30, 52]], "open": None}
    meta = json.loads(json.dumps(meta))
    b3, m3 = memory(tiny_model, tmp_path / "c")
    m3.load_state(meta, {k: t.clone() for k, t in tensors.items()})
    rest, _ = greedy(b3, m3, logits, 30)
    assert first + rest == want
    assert m3.pictures.spans == m1.pictures.spans and m3.working.state() == m1.working.state()


@pytest.mark.parametrize(
    "pictures",
    [
        {"spans": [[30, 52], [40, 60]], "open": None},  # overlapping
        {"spans": [[30, 10_000]], "open": None},  # past the tokens
        {"spans": [[30, 52]], "open": [10, 1, 5]},  # an open one before a closed one
        {"spans": [[30, 52]], "open": [90, 9, 20]},  # more of it fed than there are tokens
        {"spans": [[30, 52]]},
        {"spans": "all", "open": None},
    ],
)
def test_a_state_naming_impossible_pictures_is_refused(tiny_model: Path, pictures: object) -> None:
    ids = random_ids(30, seed=1, vocab=TEXT_VOCAB) + picture([5, 6]) + random_ids(40, seed=2, vocab=TEXT_VOCAB)
    b, m = memory(tiny_model)
    prompt(b, m, ids, 16)
    meta, tensors = m.state()
    meta["pictures"] = pictures
    with pytest.raises(SessionFileError, match="picture"):
        memory(tiny_model)[1].load_state(meta, tensors)


def test_a_full_window_without_pictures_is_still_required(tiny_model: Path) -> None:
    """A text state whose window is short after evicting is refused, as before (only pictures leave early)."""
    b, m = memory(tiny_model)
    ids = random_ids(30, seed=1, vocab=TEXT_VOCAB) + picture([5, 6]) + random_ids(40, seed=2, vocab=TEXT_VOCAB)
    prompt(b, m, ids, 16)
    meta, tensors = m.state()
    assert meta["working"]["n_window"] < CFG.window  # the picture left whole, the window not yet refilled
    del meta["pictures"]
    with pytest.raises(SessionFileError, match="working memory"):
        memory(tiny_model)[1].load_state(meta, tensors)


def test_a_picture_longer_than_the_window_leaves_in_pieces(tiny_model: Path) -> None:
    """It cannot be wholly in a window shorter than it: it leaves as text does, and its state still restores."""
    b, m = memory(tiny_model)
    long_picture = picture(random_ids(40, seed=4, vocab=TEXT_VOCAB))  # a 60-token span, the window 48
    ids = random_ids(30, seed=1, vocab=TEXT_VOCAB) + long_picture + random_ids(70, seed=2, vocab=TEXT_VOCAB)
    feeder = PromptFeed(ids, 0, m.prefill_cut(ids, 0))
    partly = set()
    while not feeder.done:
        feed(b, m, feeder.next(16))
        partly.add(in_window(m, (30, 90)))
    assert m.pictures.spans == [(30, 90)] and partly - {0, 60}
    meta, tensors = m.state()
    _, m2 = memory(tiny_model)
    m2.load_state(json.loads(json.dumps(meta)), tensors)
    assert m2.pictures.spans == [(30, 90)]


# -- room for a whole picture ------------------------------------------------------------------------------------

BIG_FIRST, BIG_COUNT = 220, 40  # a picture of more blocks than CFG's 4 groups: 40 tokens and 2 between = 6+ blocks


def big_token(token: int) -> tuple[int, int] | None:
    return (token - BIG_FIRST, BIG_COUNT) if BIG_FIRST <= token < BIG_FIRST + BIG_COUNT else None


def test_a_text_geometry_is_what_it_always_was() -> None:
    """No picture, no reservation: the defaults fitted to a context as before, whatever the context."""
    base = CascadeConfig()
    for context in (512, 2048, 8192, 32768):
        plain = base.fit_to(context)
        assert plain == base.fit_to(context, None, 0)
        assert plain.retrieval_blocks == 8 and plain.used_slots == context
    assert base.fit_to(8192).window == 8192 - 4 - 256


def test_retrieval_makes_room_for_the_largest_picture_and_the_window_gives_way() -> None:
    base = CascadeConfig()
    wide = base.fit_to(8192, None, 1100)  # SmolVLM-256M's size: 17 frames of 64 and their markers
    assert wide.retrieval_blocks == -(-1100 // 32) + 1 == 36 and wide.holds_pictures(1100)
    assert wide.window == 8192 - 4 - 36 * 32 and wide.used_slots == 8192
    set_window = CascadeConfig(window=4000).fit_to(4096, None, 1100)  # an explicit window gives way first
    assert set_window.retrieval_blocks == 36 and set_window.window == 4096 - 4 - 36 * 32
    assert base.fit_to(8192, None, 200) == base.fit_to(8192)  # a picture the 8 groups already hold
    assert CascadeConfig(retrieval_blocks=12).fit_to(8192, None, 300).retrieval_blocks == 12
    assert CascadeConfig(retrieval_blocks=0).fit_to(8192, None, 1100) == CascadeConfig(retrieval_blocks=0).fit_to(8192)


def test_a_context_that_cannot_hold_the_picture_keeps_the_text_geometry() -> None:
    base = CascadeConfig()
    small = base.fit_to(1536, None, 1100)  # 36 groups would leave a window shorter than the picture
    assert small == base.fit_to(1536) and not small.holds_pictures(1100)
    capped = base.fit_to(8192, 1024, 1100)  # the memory budget's slot table, likewise
    assert capped == base.fit_to(8192, 1024) and not capped.holds_pictures(1100)


def recall_one_block(
    tiny_model: Path, cfg: CascadeConfig, monkeypatch: pytest.MonkeyPatch
) -> tuple[CascadeMemory, list[int], tuple[int, int], tuple[int, int]]:
    """A big picture fed and evicted, then one layer's routing picks one of its blocks and a text block, the others
    two other text blocks: the memory, the picture's blocks, its span, the first layer's text block and the others'
    first."""
    b = TorchBackend(tiny_model)
    m = CascadeMemory(b, cfg, pictures=big_token)
    big = [*range(BIG_FIRST, BIG_FIRST + 20), 5, 6, *range(BIG_FIRST + 20, BIG_FIRST + BIG_COUNT)]
    ids = random_ids(30, seed=1, vocab=TEXT_VOCAB) + big + random_ids(90, seed=2, vocab=TEXT_VOCAB)
    prompt(b, m, ids, 16)
    (span,) = m.pictures.spans
    blocks = list(m.pictures.blocks(cfg.sink_tokens, cfg.block_size)[0])
    assert in_window(m, span) == 0 and set(blocks) <= set(m.episodic.blocks)
    text = [i for i in sorted(m.episodic.blocks) if i not in blocks]
    picks = [[blocks[2], text[-1]]] + [[text[0], text[1]]] * (m.working.num_layers - 1)
    monkeypatch.setattr(m.episodic, "select", lambda *a, **k: [list(p) for p in picks])
    m.retriever.route(prefill=True, answering=False)
    return m, blocks, span, (text[-1], text[0])


def test_a_picture_larger_than_the_groups_comes_back_whole_where_room_was_made(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = CFG.fit_to(512, None, BIG_COUNT + 2)
    assert cfg.retrieval_blocks == -(-(BIG_COUNT + 2) // CFG.block_size) + 1 > CFG.retrieval_blocks
    m, blocks, span, (text_block, other_block) = recall_one_block(tiny_model, cfg, monkeypatch)
    assert len(blocks) > CFG.retrieval_blocks
    for layer in m.working.groups:  # in every layer: its blocks in consecutive groups, in order
        at = layer.index(blocks[0])
        assert layer[at : at + len(blocks)] == blocks
    # The group it leaves goes to text routing: each layer's own best other pick.
    assert [sorted(set(layer) - set(blocks)) for layer in m.working.groups] == [[text_block]] + [[other_block]] * (
        m.working.num_layers - 1
    )
    # Count its tokens back: every token of the span sits in a group's block, that block's KV in the group's slots.
    for layer, groups in enumerate(m.working.groups):
        back = set()
        for g, bid in enumerate(groups):
            k, _ = m.backend.read_kv(0, m.working.group_slots(g))
            assert torch.equal(k[layer], m.episodic.blocks[bid].k[layer])
            back |= {t for t in range(4 + bid * 8, 4 + (bid + 1) * 8) if span[0] <= t < span[1]}
        assert len(back) == span[1] - span[0] == BIG_COUNT + 2


def test_without_the_room_a_big_picture_is_routed_block_by_block(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the reservation is for: in 4 groups the picture cannot come back whole, only the block picked."""
    m, blocks, _, _ = recall_one_block(tiny_model, CFG, monkeypatch)
    assert [b for b in m.working.groups[0] if b in blocks] == [blocks[2]]
