"""Fuzzing `.spark` reading: whatever the bytes, the only outcome is a restored session or one SessionFileError —
never another exception, a hang, an allocation the file chose, or a partial restore; and `verify` (with the
model) passes exactly the files `restore` restores, which then continue generating.

Bounded for a 2-core CI: small files (~100 KiB), a couple of hundred examples, a memory cap around each example,
no example database written into the tree. `make fuzz` runs the same mutations at scale (tests/fuzz_sessions.py).
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.errors import SessionFileError
from engine.session.file import (
    RestoredSession,
    inspect_session,
    load_session,
    restore,
    verify_session,
)
from tests.engine.memory.cascade.helpers import feed
from tests.engine.session.session_fuzzing import World, memory_cap, mutated_file

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SCHEMA_FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
CAP = 1 << 30  # far above what any example needs (a few MB), far below what the files asked for (5 GB)
NAMES = ["none", "zlib", "lzma"]
EDGE_LENGTHS = [0, 1, 2**31, 2**32 + 7, 2**63, 2**64 - 1]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("fuzz"))


def test_the_seed_files_are_sound_and_restore(world: World, tmp_path: Path) -> None:
    target = world.factory(None)(world.backend()).state_target()
    for name, raw in world.files.items():
        path = tmp_path / f"{name}.spark"
        path.write_bytes(raw)
        assert load_session(path).compression == name  # every codec really is exercised
        verify_session(path, target)
        assert isinstance(restore(path, world.backend(), world.factory(world.store("seed"))), RestoredSession)


@st.composite
def mutations(draw: st.DrawFn, files: dict[str, bytes]) -> tuple[str, bytes]:
    name = draw(st.sampled_from(NAMES))
    raw = bytearray(files[name])
    op = draw(st.sampled_from(["truncate", "flip", "splice", "inflate", "overwrite", "garbage"]))
    if op == "truncate":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif op == "flip":
        for _ in range(draw(st.integers(1, 6))):
            raw[draw(st.integers(0, len(raw) - 1))] ^= 1 << draw(st.integers(0, 7))
    elif op == "splice":  # replace a span with a span of another (or the same) file
        other = files[draw(st.sampled_from(NAMES))]
        a = draw(st.integers(0, len(raw)))
        b = draw(st.integers(a, len(raw)))
        c = draw(st.integers(0, len(other)))
        d = draw(st.integers(c, len(other)))
        raw = raw[:a] + other[c:d] + raw[b:]
    elif op == "inflate":
        at = draw(st.sampled_from([12, 20, 28]))
        value = draw(st.one_of(st.sampled_from([*EDGE_LENGTHS, len(raw), 2 * len(raw)]), st.integers(0, 2**64 - 1)))
        struct.pack_into("<Q", raw, at, value)
    elif op == "overwrite":
        junk = draw(st.binary(min_size=1, max_size=64))
        at = draw(st.integers(0, len(raw) - 1))
        raw[at : at + len(junk)] = junk
    else:
        prefix = draw(st.sampled_from([b"", b"SPARK\x00", b"SPARK\x00\x02\x00", b"SPARK\x00\x01\x00"]))
        raw = bytearray(prefix + draw(st.binary(max_size=512)))
    return op, bytes(raw)


@FUZZ
@given(data=st.data())
def test_damaged_files_only_ever_raise_session_file_error(
    world: World, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    op, raw = data.draw(mutations(world.files), label="mutation")
    if raw in world.files.values():  # e.g. an empty splice: still sound, covered by the seed test
        return
    path = tmp_path_factory.mktemp("damaged") / "f.spark"
    path.write_bytes(raw)
    backend = world.backend()
    before = backend.cache.k.clone() if getattr(backend, "cache", None) is not None else None
    with memory_cap(CAP):
        for attempt in (load_session, inspect_session, lambda p: restore(p, backend, world.factory(None))):
            with pytest.raises(SessionFileError) as info:
                attempt(path)
            message = str(info.value)
            assert message and "\n" not in message and message.endswith("."), message
    assert before is None or torch.equal(backend.cache.k, before), f"{op}: the backend's KV changed"


@SCHEMA_FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_verify_passes_exactly_what_restores_and_continues(
    world: World, tmp_path_factory: pytest.TempPathFactory, rng: random.Random
) -> None:
    """Schema-aware: any field of the metadata or the memory state, or a tensor, made hostile behind a valid
    checksum. verify(with the model) OK <=> restore OK, and a restored memory spills and generates."""
    root = tmp_path_factory.mktemp("schema")
    path = root / "f.spark"
    world_files_before = {
        p: p.stat().st_mtime_ns for p in world.root.rglob("*") if "l3" not in p.relative_to(world.root).parts
    }
    what = mutated_file(world, rng, path)
    backend = world.backend()
    store = world.store(f"fuzz-{rng.randrange(4)}")
    target = world.factory(None)(world.backend()).state_target()
    with memory_cap(CAP):
        try:
            verify_session(path, target, world.fingerprint)
            verified = None
        except SessionFileError as exc:
            verified = str(exc)
        try:
            outcome = restore(path, backend, world.factory(store))
        except SessionFileError as exc:
            assert verified is not None, f"{what}: verify passed, restore refused: {exc}"
            assert "\n" not in str(exc) and str(exc).endswith(".")
            event("refused")
            return
        assert verified is None, f"{what}: verify refused ({verified}) what restore restored"
        if not isinstance(outcome, RestoredSession):  # another model's file: transcript only, nothing to continue
            event("transcript only")
            return
        memory = outcome.memory
        memory.spill()  # writes KV under l3 keys read from the file: they must stay inside the store
        pending = outcome.data.pending_token if outcome.data.pending_token is not None else 1
        logits = feed(backend, memory, [pending])
        assert torch.isfinite(logits).all()
        event("restored")
    outside = {p: p.stat().st_mtime_ns for p in world.root.rglob("*") if "l3" not in p.relative_to(world.root).parts}
    assert outside == world_files_before, f"{what}: a file outside the store was written"
    assert [p.name for p in root.iterdir()] == ["f.spark"], f"{what}: something was written next to the session file"
