"""The issue's crafted files, one by one: each passed the checksum and was trusted; each is now refused by
`session verify` and by restore with one sentence, before anything is allocated or written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.errors import SessionFileError
from engine.session.file import RestoredSession, load_session, restore, verify_session
from tests.engine.session.session_fuzzing import CONFIG, World, memory_cap
from tests.engine.session.session_helpers import write_v2


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("schema"))


def _stub_block(world: World) -> int:
    return next(i for i, b in enumerate(world.file_meta["memory"]["episodic"]["blocks"]) if not b[5])


CASES: dict[str, tuple[list[Any], Any]] = {
    # path into the metadata -> the hostile value
    "l3_key escaping the store": (["memory", "episodic", "blocks", "STUB", 2], "../" * 20 + "abcd"),
    "l3_key absolute": (["memory", "episodic", "blocks", "STUB", 2], "/work/models/smollm2-hf/model.safetensors"),
    "window fill choosing an arange": (["memory", "working", "n_window"], 3 * 10**8),
    "rows choosing a torch.full": (["memory", "episodic", "rows"], 2**31),
    "rows past int64": (["memory", "episodic", "rows"], 2**70),
    "persisted true": (["memory", "prefix", "persisted"], True),
    "persisted off a block edge": (["memory", "prefix", "persisted"], 3),
    "seed true": (["settings", "sampling", "seed"], True),
    "seed 1.5": (["settings", "sampling", "seed"], 1.5),
    "seed a string": (["settings", "sampling", "seed"], "7"),
    "seed past 64 bits": (["settings", "sampling", "seed"], 2**64),
    "sampler state too short": (["sampler_state"], [1, 2, 3]),
    "memory token outside the vocabulary": (["memory", "tokens", 0], 10**6),
    "a string where an object belongs": (["memory", "working"], "working"),
    "slot outside the table": (["memory", "routing", "last_slots"], [10**6]),
    "group naming a block never formed": (["memory", "working", "groups", 0], 10**6),
    "timestamp past year 9999": (["messages", 0, "timestamp"], 10**15),
    "reasoning not text": (["messages", 0, "reasoning"], ["a thought"]),
    "created negative": (["created"], -1e18),
    "geometry changed": (["memory", "config", "window"], 64),
    "ring head out of range": (["memory", "working", "head"], 10**6),
    "counter negative": (["memory", "counters", "hits"], -1),
}
RAW: dict[str, tuple[str, str]] = {
    # the text written where a value was, as only a hostile writer would
    "Infinity": ('"tick":', '"tick":Infinity,"x":'),
    "huge exponent": ('"tick":', '"tick":1e999,"x":'),
    "NaN": ('"since_route":', '"since_route":NaN,"y":'),
    "lone surrogate": ('"content":"Hello"', '"content":"Hel\\ud800lo"'),
    "huge integer": ('"next_id":', '"next_id":' + "9" * 4000 + ',"z":'),
}


def _restore_refuses(world: World, path: Path) -> None:
    backend = world.backend()
    backend.allocate(1, CONFIG.num_slots)  # the table the memory uses, so a refusal can be seen to write nothing
    target = world.factory(None)(world.backend()).state_target()
    before = backend.cache.k.clone()
    with memory_cap(512 << 20):  # the files asked for 2.7-5 GB; the check allocates nothing
        for attempt in (
            lambda: verify_session(path, target),
            lambda: restore(path, backend, world.factory(world.store("schema"))),
        ):
            with pytest.raises(SessionFileError) as info:
                attempt()
            assert "\n" not in str(info.value) and str(info.value).endswith(".")
    assert torch.equal(backend.cache.k, before)


@pytest.mark.parametrize("name", sorted(CASES))
def test_crafted_metadata_is_refused_before_anything_is_allocated(world: World, tmp_path: Path, name: str) -> None:
    meta = json.loads(json.dumps(world.file_meta))
    path, value = CASES[name]
    path = [_stub_block(world) if p == "STUB" else p for p in path]
    obj = meta
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
    write_v2(tmp_path / "f.spark", json.dumps(meta).encode(), world.section)
    _restore_refuses(world, tmp_path / "f.spark")


@pytest.mark.parametrize("name", sorted(RAW))
def test_values_json_dumps_never_writes_are_refused(world: World, tmp_path: Path, name: str) -> None:
    old, new = RAW[name]
    text = json.dumps(world.file_meta, separators=(",", ":"))
    assert old in text
    write_v2(tmp_path / "f.spark", text.replace(old, new, 1).encode(), world.section)
    _restore_refuses(world, tmp_path / "f.spark")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_kv_is_refused(world: World, tmp_path: Path, value: float) -> None:
    tensors = dict(st_load(world.section))
    k = tensors["wk.k"].clone()
    k[0, 0, 3, 5] = value
    tensors["wk.k"] = k
    write_v2(tmp_path / "f.spark", json.dumps(world.file_meta).encode(), st_save(tensors))
    with pytest.raises(SessionFileError, match="NaN or infinite"):
        load_session(tmp_path / "f.spark")
    _restore_refuses(world, tmp_path / "f.spark")


def test_the_unmodified_file_restores(world: World, tmp_path: Path) -> None:
    write_v2(tmp_path / "f.spark", json.dumps(world.file_meta).encode(), world.section)
    assert isinstance(restore(tmp_path / "f.spark", world.backend(), world.factory(None)), RestoredSession)
