"""The attached blocks' lexical index (engine.memory.cascade.lexical): BM25 over token ids ranks the block holding a
question's rare words first among look-alike blocks, deterministically, and refuses what is not whole blocks of
token ids; the blocks it names join every layer's retrieval groups (engine.memory.cascade.retrieval)."""

from __future__ import annotations

import pytest

from engine.memory.cascade import lexical
from engine.memory.cascade.lexical import LexicalIndex
from engine.memory.cascade.retrieval import consensus_groups

B = 8
TEMPLATE = [1, 2, 3, 4]  # "the pass key of": in every block
FILLER = [5, 6, 7, 8]


def _look_alikes(names: list[tuple[int, int]]) -> list[int]:
    """One block per (colour, place) name: the template, the name, filler. Every block reads alike but for its name."""
    out: list[int] = []
    for colour, place in names:
        out += [*TEMPLATE, colour, place, *FILLER[:2]]
    return out


NAMES = [(100, 200), (101, 201), (100, 202), (102, 200), (103, 203), (101, 204)]


def test_the_block_sharing_the_questions_rare_words_ranks_first() -> None:
    index = LexicalIndex()
    index.add(10, _look_alikes(NAMES), B)
    question = FILLER + TEMPLATE + [100, 200] + [3, 4]  # "... the pass key of the red harbour is"
    assert index.top(question, 3, 0.0)[0] == 10  # the block naming both words, though each word is in two blocks
    assert index.top(FILLER + TEMPLATE + [103, 203], 1, 0.0) == [14]
    # Words every block holds weigh next to nothing: the template alone names no block clearly.
    s = index.scores([*TEMPLATE, 102])
    assert int(s.argmax()) == 3 and float(s[3]) > 5 * float(s[0])


def test_ranking_is_deterministic_and_ignores_repetition_and_order() -> None:
    index = LexicalIndex()
    index.add(0, _look_alikes(NAMES), B)
    q = [*TEMPLATE, 100, 200, 101]
    assert index.top(q, 6, 0.0) == index.top(list(reversed(q)) * 3, 6, 0.0)
    other = LexicalIndex()
    other.add(0, _look_alikes(NAMES), B)
    assert other.scores(q).tolist() == index.scores(q).tolist()
    # Equal scores go to the older block.
    assert index.top([*TEMPLATE, 101], 2, 0.0) == [1, 5]


def test_only_blocks_clearly_named_are_returned() -> None:
    index = LexicalIndex()
    index.add(0, _look_alikes(NAMES), B)
    assert index.top([*TEMPLATE, 100, 200], 4, 0.9) == [0]  # the two half-matches score well below the full one
    assert index.top([999, 998], 4, 0.0) == []  # words no block holds
    assert index.top([], 4, 0.0) == [] and LexicalIndex().top([1], 4, 0.0) == []


def test_the_index_refuses_what_is_not_whole_blocks_of_token_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    index = LexicalIndex()
    with pytest.raises(ValueError, match="whole blocks"):
        index.add(0, [1, 2, 3], B)
    with pytest.raises(ValueError, match="whole blocks"):
        index.add(0, [1] * B, 0)
    with pytest.raises(ValueError, match="out of range"):
        index.add(0, [1] * (B - 1) + [-1], B)
    with pytest.raises(ValueError, match="out of range"):
        index.add(0, [1] * (B - 1) + [1 << 40], B)
    monkeypatch.setattr(lexical, "MAX_BLOCKS", 2)
    index.add(0, [1] * (2 * B), B)
    with pytest.raises(ValueError, match="at most 2 blocks"):
        index.add(2, [1] * B, B)
    assert len(index) == 2  # a refused add leaves the index as it was


def test_named_blocks_take_the_first_groups_of_every_layer() -> None:
    chosen = [[1, 2, 3, 4], [2, 1, 5, 6], [7, 2, 1, 8]]
    assert consensus_groups(chosen, 0, 2, named=(9,)) == [[9, 1], [9, 2], [9, 7]]
    assert consensus_groups(chosen, 2, 3, named=(9,)) == [[2, 9, 1], [2, 9, 1], [2, 9, 7]]
    assert consensus_groups(chosen, 2, 3, named=(9, 8, 3)) == [[3, 8, 9]] * 3
    assert consensus_groups(chosen, 2, 3) == [[1, 2, 3], [1, 2, 5], [1, 2, 7]]


def test_a_passage_is_the_named_blocks_and_those_around_them_in_their_own_text() -> None:
    index = LexicalIndex()
    index.add(100, [1] * (6 * B), B)  # one text: blocks 100..105
    index.add(200, [2] * (3 * B), B)  # another: 200..202
    assert index.passage([102], 4) == [102, 101, 103, 100]  # nearest first, the older side first
    assert index.passage([105, 100], 4) == [105, 100, 104, 101]  # never past its own text's ends
    assert index.passage([200], 8) == [200, 201, 202]  # a short text gives what it has
    assert index.passage([], 4) == []


def test_words_most_blocks_share_name_no_passage() -> None:
    index = LexicalIndex()
    index.add(0, _look_alikes(NAMES), B)
    assert index.top([*TEMPLATE, 100], 4, 0.5, least=2.5) == []  # a word two blocks in six hold: too common
    many = LexicalIndex()
    many.add(0, _look_alikes(NAMES) + [9] * (B * 40), B)
    assert many.top([*TEMPLATE, 103], 4, 0.8, least=2.5) == [4]  # a word one block in 46 holds
    # The template's blocks score two thirds as high but hold none of the question's rare words: no tie.
    assert many.top([*TEMPLATE, 103], 4, 0.5, least=2.5) == [4]


def test_a_block_holding_only_some_of_the_best_blocks_rare_words_is_no_near_tie() -> None:
    index = LexicalIndex()
    index.add(0, _look_alikes([*NAMES, (104, 205), (105, 206)]) + [9] * (B * 40), B)  # one block in 48 each
    question = [*TEMPLATE, 100, 200]  # "the red harbour": blocks 0 (both words), 2 (red) and 3 (harbour)
    s = index.scores(question)
    assert float(s[2]) >= 0.4 * float(s[0]) and float(s[3]) >= 0.4 * float(s[0])
    assert index.top(question, 4, 0.4, least=2.5) == [0]  # each holds one of the two names: a partial match
    # A block holding a rare word of the question that the best lacks is a near-tie: asked about the red harbour
    # and the red tower, the red tower (202: the rarest word) is first, the red harbour and the harbour beside it.
    assert index.top([*TEMPLATE, 100, 200, 202], 4, 0.4, least=2.5) == [2, 0, 3]


def test_a_window_scores_a_fact_cut_by_a_blocks_edge_whole_and_names_a_passage_once() -> None:
    index = LexicalIndex()
    filler = [9] * B
    # One text: the red harbour's fact cut by a block's edge (red ends block 3, harbour starts block 4), another
    # fact naming red with the whole template (block 8); a second text right after it, whose first block names
    # harbour.
    text = [
        *filler * 3,
        *[1, 2, 5, 6, 7, 8, 5, 100],  # "the pass ... red"
        *[200, 3, 4, 7, 8, 5, 6, 7],  # "harbour ... key of"
        *filler * 3,
        *[*TEMPLATE, 100, 201, 5, 6],
    ]
    index.add(0, text + filler * 30, B)
    index.add(index.spans[-1][1], [200, *[9] * (B - 1)] + filler * 5, B)
    question = [*TEMPLATE, 100, 200]
    alone = index.scores(question)
    assert float(alone[8]) > float(alone[3]) and float(alone[8]) > float(alone[4])  # block by block, "red" wins
    windows = index.scores(question, radius=1)
    assert {int(r) for r in (windows == windows.max()).nonzero().flatten()} == {3, 4}  # both halves in view
    # Adjacent windows tie (each holds both halves): the passage is named once, its older middle block.
    assert index.top(question, 4, 0.5, least=2.5, radius=1) == [3]
    # A window never reads across into another text: the text's last block does not see the next one's "harbour".
    last = index.spans[0][1] - 1
    assert float(index.scores([200], radius=1)[last - index.ids[0]]) == 0.0


def test_a_passage_is_read_around_its_own_best_block() -> None:
    index = LexicalIndex()
    often = [5, *[9] * (B - 1)]  # a word of the question some filler blocks hold too
    index.add(0, often + often + [*TEMPLATE, 100, 200, 9, 9] + [9] * B * 30 + often * 8, B)
    question = [*TEMPLATE, 100, 200, 5]
    windows = index.scores(question, radius=1)
    assert float(windows[1]) > float(windows[2])  # the window ending at the fact holds the common word twice
    assert index.top(question, 4, 0.8, least=2.5, radius=1) == [2]  # its passage is read around the fact


def test_a_removed_text_is_never_named_again_and_leaves_the_others_scores_as_if_never_added() -> None:
    alone, both = LexicalIndex(), LexicalIndex()
    alone.add(10, _look_alikes(NAMES), B)
    both.add(10, _look_alikes(NAMES), B)
    both.add(16, _look_alikes([(104, 205), (100, 200)]), B)
    question = FILLER + TEMPLATE + [100, 200]
    assert 17 in both.top(question, 8, 0.0)
    both.remove(16)
    assert both.ids == alone.ids and both.top(question, 8, 0.0) == alone.top(question, 8, 0.0)
    assert both.scores(question).tolist() == alone.scores(question).tolist()
    both.remove(16)  # gone already: nothing happens
    assert len(both) == len(alone)
