"""A model whose pictures attend both ways reads each picture's run of ids in one forward: a chunk the run begins
grows to hold it (up to the most one forward takes), a chunk or a cut that would end inside one ends before it
(and the chunk that holds the run ends with it); and
a step's mask lets a picture's tokens see the later tokens of their own picture in that step, no other's."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.generation.loop import PromptFeed
from engine.model.slots import SlotBatch, image_runs, open_image_runs

V = 100  # ids from V up are a picture's


def sizes(ids: list[int], chunk: int, cuts: Sequence[int] = (), whole: int = 64) -> list[int]:
    feed = PromptFeed(ids, 0, cuts, image_from=V, whole_runs=whole)
    steps = feed.steps(chunk)
    out = []
    while not feed.done:
        out.append(len(feed.next(chunk)))
    assert steps == len(out)
    return out


def test_a_chunk_grows_to_hold_the_run_it_begins() -> None:
    assert sizes([1, *range(200, 210), 2, 3], 4) == [1, 10, 2]
    assert sizes([*range(200, 204), 1, 2, 3, 4, 5], 3) == [4, 3, 2]  # a prompt read from inside a run (a restore)


def test_a_cut_inside_a_run_moves_to_its_ends() -> None:
    assert sizes([1, 2, 200, 201, 202, 3], 8, [3]) == [2, 3, 1]  # before the run, and the chunk ends with it
    assert sizes([1, 2, 200, 201, 202, 3], 8, [2, 4]) == [2, 3, 1]  # a cut at the run's start stays
    assert sizes([1, 2, 200, 201, 202, 3], 8, [5]) == [5, 1]  # a cut at its end too


def test_a_run_longer_than_one_forward_is_cut_there() -> None:
    assert sizes([1, *range(200, 210)], 4, whole=6) == [1, 6, 4]


def test_the_run_of_one_picture_and_not_the_next() -> None:
    tokens = torch.tensor([[1, 200, 201, 2, 300, 301, 302]])
    runs = image_runs(tokens, V)[0]
    expected = {(1, 2), (4, 5), (4, 6), (5, 6)}
    assert {(i, j) for i, j in runs.nonzero().tolist()} == expected


def test_the_step_mask_opens_the_later_slots_of_a_picture_only() -> None:
    tokens = torch.tensor([[1, 200, 201, 202]])
    slots = torch.tensor([[10, 11, 12, 13]])  # written out of order: the mask's columns are slots
    causal = torch.zeros(1, 1, 4, 14, dtype=torch.bool)
    for i in range(4):
        causal[0, 0, i, :10] = True
        causal[0, 0, i, slots[0, : i + 1]] = True
    local = causal.clone()
    local[0, 0, :, :10] = False  # a sliding layer's window: none of the older slots
    batch = SlotBatch(tokens.clone(), slots, torch.arange(14)[None], causal, local_mask=local)
    opened = open_image_runs(batch, tokens, V)
    added = opened.mask & ~causal
    assert {(i, s) for _, _, i, s in added.nonzero().tolist()} == {(1, 12), (1, 13), (2, 13)}
    assert opened.local_mask is not None and torch.equal(opened.local_mask & ~local, added)
    assert open_image_runs(batch, torch.tensor([[1, 2, 3, 4]]), V) is batch  # no picture: the step unchanged
