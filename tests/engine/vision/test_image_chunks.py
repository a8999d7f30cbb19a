"""A prompt's chunks keep a picture's run of ids whole: a chunk the size limit would end inside a run ends before
it, a run longer than a chunk is fed in chunk-sized pieces, and the memory's cuts stay where they are."""

from __future__ import annotations

from collections.abc import Sequence

from engine.generation.loop import PromptFeed

V = 100  # ids from V up are a picture's


def sizes(ids: list[int], chunk: int, cuts: Sequence[int] = (), image_from: int | None = V) -> list[int]:
    feed = PromptFeed(ids, 0, cuts, image_from=image_from)
    out = []
    while not feed.done:
        out.append(len(feed.next(chunk)))
    return out


def test_a_chunk_ends_before_a_picture_it_would_cut() -> None:
    ids = [1, 2, 3, 200, 201, 202, 4, 5]
    assert sizes(ids, 4) == [3, 4, 1]
    assert sizes(ids, 4, image_from=None) == [4, 4]  # a text-only feed: chunks of the size limit


def test_a_run_longer_than_a_chunk_is_fed_in_pieces() -> None:
    assert sizes([1, *range(200, 210), 2], 4) == [1, 4, 4, 3]


def test_the_memorys_cuts_stay() -> None:
    assert sizes([1, 2, 200, 201, 202, 3], 8, [4]) == [4, 2]
