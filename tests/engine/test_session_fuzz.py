"""Fuzzing `.spark` reading: whatever the bytes, the only outcome is a restored session or one SessionFileError —
never another exception, a hang, or a partial restore (the live conversation and backend stay untouched).

Bounded for a 2-core CI: small files (a few KiB), a few hundred examples, a per-example deadline, no example
database written into the tree.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from engine.backends.base import Backend
from engine.backends.torch_backend import TorchBackend
from engine.errors import SessionFileError
from engine.memory import FullAttentionMemory
from engine.session_file import ForeignModelSession, RestoredSession, inspect_session, load_session, restore, save_session
from tests.engine.session_helpers import feed, v1_meta, write_v1, write_v2
from tests.tiny import make_tiny_model

FUZZ = settings(max_examples=300, deadline=5000, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SCHEMA_FUZZ = settings(max_examples=150, deadline=5000, database=None, suppress_health_check=[HealthCheck.too_slow])
PROMPT = [1, 17, 42, 99, 7, 250, 3, 64]


class World:
    """One tiny model, a live conversation on it, and the valid files the fuzzers start from."""

    def __init__(self, root: Path) -> None:
        model = make_tiny_model(root / "model")
        self.live = TorchBackend(model, "cpu")
        self.live.allocate(1, 32)
        memory = FullAttentionMemory(self.live)
        feed(self.live, memory, PROMPT)
        self.live_tokens = list(memory.tokens)
        self.target = TorchBackend(model, "cpu")  # where schema-fuzzed restores write
        self.target.allocate(1, 32)
        meta, tensors = memory.state()
        # Low-entropy extra tier, so the compressed variants really are compressed.
        tensors = {**tensors, "episodic.k": torch.randint(0, 4, (2, 2, 8, 16), generator=torch.Generator().manual_seed(0)).half()}
        self.meta, self.tensors = meta, tensors
        common = dict(
            fingerprint=self.live.fingerprint,
            tokenizer_hash="t" * 64,
            messages=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}],
            system_prompt="Be brief.",
            settings={"max_tokens": 8},
            memory_state=(meta, tensors),
            pending_token=5,
            sampler_state=[1, 2, 3],
        )
        self.files: dict[str, bytes] = {}
        for compression in ("none", "zlib", "lzma"):
            path = root / f"{compression}.spark"
            save_session(path, compression=compression, **common)  # type: ignore[arg-type]
            assert load_session(path).compression == compression
            self.files[compression] = path.read_bytes()
        v1 = root / "v1.spark"
        write_v1(v1, v1_meta(self.live.fingerprint, meta["tokens"], 5, meta, [1, 2, 3]), st_save(tensors))
        self.files["v1"] = v1.read_bytes()
        self.v2_meta = json.loads(self.files["none"][68 : 68 + struct.unpack_from("<Q", self.files["none"], 12)[0]])
        self.section = st_save(tensors)
        self.snapshot = (self.live.cache.k.clone(), self.live.cache.v.clone())
        self.path = root / "fuzzed.spark"

    def live_untouched(self) -> bool:
        return torch.equal(self.live.cache.k, self.snapshot[0]) and torch.equal(self.live.cache.v, self.snapshot[1])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("fuzz"))


NAMES = ["none", "zlib", "lzma", "v1"]
LENGTH_FIELDS = {"none": (12, 20, 28), "zlib": (12, 20, 28), "lzma": (12, 20, 28), "v1": (8, 16)}
EDGE_LENGTHS = [0, 1, 2**31, 2**32 + 7, 2**63, 2**64 - 1]


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
        at = draw(st.sampled_from(LENGTH_FIELDS[name]))
        value = draw(st.one_of(st.sampled_from(EDGE_LENGTHS + [len(raw), 2 * len(raw)]), st.integers(0, 2**64 - 1)))
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
def test_mutated_files_only_ever_raise_session_file_error(world: World, data: st.DataObject) -> None:
    op, raw = data.draw(mutations(world.files), label="mutation")
    world.path.write_bytes(raw)
    unchanged = raw in world.files.values()  # e.g. an empty splice
    calls: list[Backend] = []

    def factory(backend: Backend) -> FullAttentionMemory:
        calls.append(backend)
        return FullAttentionMemory(backend)

    if unchanged:  # still a sound file: it must restore (into the scratch backend, leaving the live one alone)
        load_session(world.path), inspect_session(world.path)
        assert isinstance(restore(world.path, world.target, FullAttentionMemory), RestoredSession)
        return
    for attempt in (load_session, inspect_session, lambda p: restore(p, world.live, factory)):
        with pytest.raises(SessionFileError) as info:
            attempt(world.path)
        message = str(info.value)
        assert message and "\n" not in message and message.endswith("."), message
    assert not calls, f"{op}: a memory was created for a file that failed verification"
    assert world.live_untouched(), f"{op}: the live conversation's KV changed"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**1100), 2**1100) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
META_KEYS = ["format_version", "app_version", "model_fingerprint", "tokenizer_hash", "created", "saved", "system_prompt",
             "messages", "settings", "token_ids", "pending_token", "sampler_state", "memory", "extra"]


def _set_path(obj: object, path: list[str | int], value: object, delete: bool) -> None:
    for key in path[:-1]:
        obj = obj[key]  # type: ignore[index]
    if delete:
        del obj[path[-1]]  # type: ignore[attr-defined]
    else:
        obj[path[-1]] = value  # type: ignore[index]


@SCHEMA_FUZZ
@given(data=st.data())
def test_well_checksummed_but_malformed_content_is_a_clear_error(world: World, data: st.DataObject) -> None:
    """A file with a valid checksum but hostile or buggy content (as another writer could produce)."""
    meta = json.loads(json.dumps(world.v2_meta))
    section = world.section
    target = data.draw(st.sampled_from(["meta", "nested", "tensor table"]))
    if target == "meta":
        _set_path(meta, [data.draw(st.sampled_from(META_KEYS))], data.draw(JSON), data.draw(st.booleans()))
    elif target == "nested":
        path = data.draw(st.sampled_from([["messages", 0, "role"], ["messages", 1, "timestamp"], ["memory", "tokens"], ["memory", "kind"],
                                          ["token_ids", 0], ["messages", 0]]))
        _set_path(meta, path, data.draw(JSON), data.draw(st.booleans()))
    else:
        (n,) = struct.unpack_from("<Q", section)
        table = json.loads(section[8 : 8 + n])
        name = data.draw(st.sampled_from(sorted(table)))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
        if field is None:
            table[name] = data.draw(JSON)
        else:
            table[name][field] = data.draw(st.one_of(JSON, st.sampled_from(["F16", "F64", "I64", [0, 2**62], [1, 2, 3, 4]])))
        header = json.dumps(table).encode()
        section = struct.pack("<Q", len(header)) + header + section[8 + n :]
    write_v2(world.path, json.dumps(meta).encode(), section)
    try:
        outcome = restore(world.path, world.target, FullAttentionMemory)
    except SessionFileError as exc:
        assert "\n" not in str(exc) and str(exc).endswith(".")
        event("refused")
    else:
        assert isinstance(outcome, (RestoredSession, ForeignModelSession))
        event(type(outcome).__name__)
    try:
        inspect_session(world.path)
    except SessionFileError:
        pass
    assert world.live_untouched()
