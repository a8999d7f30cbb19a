"""Shared by the GGUF fuzz test (hypothesis) and `python -m tests.fuzz_models`: structure-aware mutations of a
GGUF's header (metadata values and types, array and string lengths that lie, tensor names, ranks, dims, types and
offsets, block_count, vocabulary, merges, special ids, chat templates built to loop, nest or explode) and
byte-level damage (truncation, flipped bytes), written as a new file that keeps the seed's tensor data.

Every mutation takes a `random.Random`, so hypothesis (through `st.randoms()`) and the plain fuzz loop share them.
"""

from __future__ import annotations

import random
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.loading.gguf_header import ARRAY, BOOL, STRING, read_header

U8, I8, U16, I16, U32, I32, F32, U64, I64, F64 = 0, 1, 2, 3, 4, 5, 6, 10, 11, 12
_FMT = {
    U8: "<B",
    I8: "<b",
    U16: "<H",
    I16: "<h",
    U32: "<I",
    I32: "<i",
    F32: "<f",
    BOOL: "<?",
    U64: "<Q",
    I64: "<q",
    F64: "<d",
}


@dataclass
class Lie:
    """An array whose count field says `count` while `items` are written (or a string whose length lies)."""

    count: int
    items: list[Any]


@dataclass
class Entry:
    key: str
    types: tuple[int, ...]
    value: Any


@dataclass
class Tensor:
    name: str
    dims: list[int]
    ggml_type: int
    offset: int


@dataclass
class Seed:
    """A GGUF taken apart: its header as entries and tensors, and where its data section starts."""

    path: Path
    version: int
    entries: list[Entry]
    tensors: list[Tensor]
    alignment: int
    data_offset: int
    size: int
    counts: tuple[int, int] | None = None  # (tensors, keys) as written, when a mutation lies about them
    cut: int | None = None  # bytes to keep of the whole file
    flips: list[tuple[int, int]] = field(default_factory=list)  # (file offset, byte) written over the result

    @classmethod
    def read(cls, path: Path) -> Seed:
        h = read_header(path)
        entries = [Entry(k, h.value_types[k], v) for k, v in h.metadata.items()]
        tensors = [Tensor(t.name, list(t.dims), t.ggml_type, t.offset) for t in h.tensors]
        return cls(path, h.version, entries, tensors, h.alignment, h.data_offset, h.file_size)

    def copy(self) -> Seed:
        return Seed(
            self.path,
            self.version,
            [Entry(e.key, e.types, e.value) for e in self.entries],
            [Tensor(t.name, list(t.dims), t.ggml_type, t.offset) for t in self.tensors],
            self.alignment,
            self.data_offset,
            self.size,
        )

    def entry(self, key: str) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)

    def set(self, key: str, types: tuple[int, ...], value: Any) -> None:
        e = self.entry(key)
        if e is None:
            self.entries.append(Entry(key, types, value))
        else:
            e.types, e.value = types, value

    @property
    def arch(self) -> str:
        e = self.entry("general.architecture")
        return str(e.value) if e else "llama"

    def write(self, out: Path) -> None:
        header = self.header_bytes()
        with open(out, "wb") as f:
            f.write(header)
            with open(self.path, "rb") as src:
                src.seek(self.data_offset)
                shutil.copyfileobj(src, f, 1 << 22)
            for pos, byte in self.flips:
                f.seek(pos)
                f.write(bytes([byte]))
            if self.cut is not None:
                f.truncate(self.cut)

    def header_bytes(self) -> bytes:
        n_tensors, n_keys = self.counts or (len(self.tensors), len(self.entries))
        parts = [b"GGUF", struct.pack("<IQQ", self.version, n_tensors, n_keys)]
        for e in self.entries:
            parts.append(_string(e.key))
            parts.append(struct.pack("<I", e.types[0]))
            parts.append(_value(e.types, e.value))
        for t in self.tensors:
            parts.append(_string(t.name))
            parts.append(struct.pack("<I", len(t.dims)))
            parts.extend(struct.pack("<Q", d & (2**64 - 1)) for d in t.dims)
            parts.append(struct.pack("<IQ", t.ggml_type & 0xFFFFFFFF, t.offset & (2**64 - 1)))
        raw = b"".join(parts)
        align = self.alignment if self.alignment and not self.alignment & (self.alignment - 1) else 32
        return raw + b"\0" * (-len(raw) % align)


def _string(s: str | bytes | Lie) -> bytes:
    if isinstance(s, Lie):
        data = "".join(s.items).encode("utf-8", "surrogatepass")
        return struct.pack("<Q", s.count & (2**64 - 1)) + data
    data = s if isinstance(s, bytes) else s.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(data)) + data


def _scalar(t: int, v: Any) -> bytes:
    if t == STRING:
        return _string(v if isinstance(v, (str, bytes, Lie)) else str(v))
    fmt = _FMT.get(t)
    if fmt is None:
        return b""
    try:
        return struct.pack(fmt, v)
    except (struct.error, TypeError, OverflowError):  # a value the type cannot hold: its low bytes, or zeros
        size = struct.calcsize(fmt)
        return ((int(v) if isinstance(v, int) else 0) % (1 << (8 * size))).to_bytes(size, "little")


def _value(types: tuple[int, ...], v: Any) -> bytes:
    if types[0] != ARRAY:
        return _scalar(types[0], v)
    item = types[1] if len(types) > 1 else U8
    items, count = (v.items, v.count) if isinstance(v, Lie) else (list(v) if isinstance(v, list) else [v], None)
    head = struct.pack("<IQ", item & 0xFFFFFFFF, (len(items) if count is None else count) & (2**64 - 1))
    if item == ARRAY:
        return head + b"".join(_value((ARRAY, U8), x) for x in items)
    return head + b"".join(_scalar(item, x) for x in items)


# -- mutations ---------------------------------------------------------------------------------------------------

HOSTILE_INTS = [
    -1,
    0,
    1,
    2,
    3,
    29,
    31,
    64,
    576,
    577,
    49151,
    49152,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    2**64 - 1,
]
HOSTILE_FLOATS = [0.0, -0.0, 5e-324, 1e-45, -1.0, 1e38, float("inf"), float("-inf"), float("nan")]
HOSTILE_STRINGS = ["", "x", "\x00", "../../../../tmp/evil", "a" * 70_000, "llama", "qwen2", "gpt2", "\x1b]0;pwned\x07"]
TEMPLATES = [
    "{% for i in range(999999999) %}{% for j in range(999999999) %}x{% endfor %}{% endfor %}",
    "{% set a = [1, 1] %}" + "".join("{% set a = [a, a] %}" for _ in range(60)) + "{{ a | tojson }}",
    "{% if true %}" * 3000 + "x" + "{% endif %}" * 3000,
    "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    "{{ x }}" * 200_000,
    "{% set s = 'x' %}{% for i in range(80) %}{% set s = s ~ s %}{% endfor %}{{ s }}",
    "{{ 'x' * 10**12 }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "{{ raise_exception('no') }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ lipsum(10**9) }}",
    "{% ",
]
TENSOR_SUFFIXES = ["attn_q.weight", "attn_k.weight", "ffn_down.weight", "attn_norm.weight", "token_embd.weight"]


def _pick_entry(seed: Seed, rng: random.Random) -> Entry:
    important = [
        e
        for e in seed.entries
        if e.key.startswith(seed.arch + ".") or e.key.startswith("tokenizer.ggml.") or e.key == "general.alignment"
    ]
    return rng.choice(important if important and rng.random() < 0.8 else seed.entries)


def _hostile_value(rng: random.Random) -> tuple[tuple[int, ...], Any]:
    kind = rng.randrange(6)
    if kind == 0:
        t = rng.choice([U8, I8, U16, I16, U32, I32, U64, I64])
        return (t,), rng.choice(HOSTILE_INTS)
    if kind == 1:
        return (rng.choice([F32, F64]),), rng.choice(HOSTILE_FLOATS)
    if kind == 2:
        return (STRING,), rng.choice(HOSTILE_STRINGS)
    if kind == 3:
        return (BOOL,), rng.random() < 0.5
    if kind == 4:
        item = rng.choice([U8, I32, F32, STRING, BOOL, U64])
        n = rng.choice([0, 1, 3])
        return (ARRAY, item), [("a" if item == STRING else 1) for _ in range(n)]
    return (ARRAY, rng.choice([U8, I32, U64, STRING, ARRAY, 13, 255])), Lie(rng.choice(HOSTILE_INTS[10:]), [])


def m_value(seed: Seed, rng: random.Random) -> str:
    e = _pick_entry(seed, rng)
    e.types, e.value = _hostile_value(rng)
    return f"value:{e.key}"


def m_count_lie(seed: Seed, rng: random.Random) -> str:
    arrays = [e for e in seed.entries if e.types[0] == ARRAY]
    e = rng.choice(arrays)
    items = list(e.value) if isinstance(e.value, list) else []
    e.value = Lie(rng.choice([len(items) + 1, len(items) - 1, 2**32, 2**40, 2**62, 2**64 - 1, 10_000_000]), items)
    return f"count:{e.key}"


def m_string_lie(seed: Seed, rng: random.Random) -> str:
    strings = [e for e in seed.entries if e.types[0] == STRING]
    e = rng.choice(strings)
    text = str(e.value)
    e.value = Lie(rng.choice([len(text.encode()) + 1, 2**40, 2**62, 2**64 - 1]), [text])
    return f"string:{e.key}"


def m_header_counts(seed: Seed, rng: random.Random) -> str:
    n_t, n_k = len(seed.tensors), len(seed.entries)
    seed.counts = rng.choice([(n_t + 1, n_k), (n_t, n_k + 1), (2**40, n_k), (n_t, 2**62), (0, n_k), (n_t - 1, n_k)])
    return "counts"


def m_version(seed: Seed, rng: random.Random) -> str:
    seed.version = rng.choice([0, 1, 4, 2**24 * 3, 2**32 - 1])
    return "version"


def m_tensor_dims(seed: Seed, rng: random.Random) -> str:
    t = rng.choice(seed.tensors)
    choice = rng.randrange(6)
    if choice == 0:
        t.dims[rng.randrange(len(t.dims))] = rng.choice(HOSTILE_INTS)
    elif choice == 1:
        t.dims.reverse()
    elif choice == 2:
        t.dims.append(rng.choice([1, 2, 2**33]))
    elif choice == 3:
        t.dims = [] if rng.random() < 0.5 else [1] * 5
    elif choice == 4:
        t.dims[-1] += rng.choice([-1, 1])
    else:
        t.dims = [d * 2 for d in t.dims]
    return f"dims:{t.name}"


def m_tensor_offset(seed: Seed, rng: random.Random) -> str:
    t = rng.choice(seed.tensors)
    other = rng.choice(seed.tensors)
    t.offset = rng.choice(
        [
            t.offset + 1,
            t.offset + 16,
            t.offset - 32,
            other.offset,
            2**64 - 32,
            2**64 - seed.data_offset,
            2**63,
            seed.size,
            0,
        ]
    )
    return f"offset:{t.name}"


def m_tensor_type(seed: Seed, rng: random.Random) -> str:
    t = rng.choice(seed.tensors)
    t.ggml_type = rng.choice([0, 1, 2, 3, 8, 12, 14, 30, 39, 40, 255, 2**32 - 1])
    return f"type:{t.name}"


def m_tensor_name(seed: Seed, rng: random.Random) -> str:
    t = rng.choice(seed.tensors)
    choice = rng.randrange(5)
    if choice == 0:
        t.name = rng.choice(seed.tensors).name
    elif choice == 1:
        t.name = rng.choice(
            ["../../etc/passwd", "blk.99.attn_q.weight", "blk.-1.attn_q.weight", "x" * 300, "", "\ud800"]
        )
    elif choice == 2:
        seed.tensors.remove(t)
    elif choice == 3:
        n = int(str(seed.entry(f"{seed.arch}.block_count").value))  # type: ignore[union-attr]
        t.name = f"blk.{n}.{rng.choice(TENSOR_SUFFIXES)}"
    else:
        t.name = t.name.replace("blk.0.", "blk.1.") if "blk.0." in t.name else t.name + ".x"
    return f"name:{t.name[:30]}"


def m_block_count(seed: Seed, rng: random.Random) -> str:
    e = seed.entry(f"{seed.arch}.block_count")
    assert e is not None
    e.value = int(e.value) + rng.choice([-1, 1, -int(e.value), 1000])
    return "block_count"


def m_sizes(seed: Seed, rng: random.Random) -> str:
    key = rng.choice(
        [
            "embedding_length",
            "attention.head_count",
            "attention.head_count_kv",
            "feed_forward_length",
            "context_length",
            "attention.key_length",
            "vocab_size",
            "rope.dimension_count",
        ]
    )
    seed.set(f"{seed.arch}.{key}", (rng.choice([U32, I32, U64, F32]),), rng.choice([*HOSTILE_INTS, 2.5, 1e-45]))
    return f"size:{key}"


def m_special_ids(seed: Seed, rng: random.Random) -> str:
    key = rng.choice(["bos", "eos", "unknown", "padding", "eot"])
    types, value = rng.choice(
        [
            ((U32,), 49152),
            ((U32,), 2**32 - 1),
            ((I32,), -1),
            ((STRING,), "<|endoftext|>"),
            ((BOOL,), True),
            ((F32,), 1.5),
        ]
    )
    seed.set(f"tokenizer.ggml.{key}_token_id", types, value)
    return f"id:{key}"


def m_vocabulary(seed: Seed, rng: random.Random) -> str:
    tokens = seed.entry("tokenizer.ggml.tokens")
    merges = seed.entry("tokenizer.ggml.merges")
    assert tokens is not None and merges is not None
    choice = rng.randrange(7)
    if choice == 0:
        tokens.value = [*tokens.value, *(f"t{i}" for i in range(rng.choice([1, 1000, 2_000_000])))]
    elif choice == 1:
        tokens.value = tokens.value[: rng.choice([1, 100, len(tokens.value) - 1])]
    elif choice == 2:
        merges.value = [*merges.value, *(f"x{i} y{i}" for i in range(rng.choice([1, 1000, 2_000_000])))]
    elif choice == 3:
        i = rng.randrange(len(merges.value))
        merges.value = [
            *merges.value[:i],
            rng.choice(["nospace", "a", " ", "zzzq qqzz", "\ud800 x"]),
            *merges.value[i + 1 :],
        ]
    elif choice == 4:
        i = rng.randrange(len(tokens.value))
        tokens.value = [
            *tokens.value[:i],
            rng.choice(["", "a" * 5000, "\ud800", tokens.value[0]]),
            *tokens.value[i + 1 :],
        ]
    elif choice == 5:
        seed.set(
            "tokenizer.ggml.token_type", (ARRAY, I32), [rng.choice([-1, 1, 3, 99]) for _ in range(len(tokens.value))]
        )
    else:
        seed.set("tokenizer.ggml.model", (STRING,), rng.choice(["llama", "bert", "", "gpt2"]))
        seed.set("tokenizer.ggml.pre", (STRING,), rng.choice(["default", "smollm", "qwen2", "unknown-pre"]))
    return f"vocab:{choice}"


def m_template(seed: Seed, rng: random.Random) -> str:
    i = rng.randrange(len(TEMPLATES))
    seed.set("tokenizer.chat_template", (STRING,), TEMPLATES[i])
    return f"template:{i}"


def m_alignment(seed: Seed, rng: random.Random) -> str:
    value = rng.choice([0, 1, 3, 7, 16, 64, 2**31, 2**32 - 1])
    seed.set("general.alignment", (U32,), value)
    if value and not value & (value - 1) and value <= 1 << 20:
        seed.alignment = value  # the header pads to it; tensor offsets may now be unaligned
    return "alignment"


def m_truncate(seed: Seed, rng: random.Random) -> str:
    end = seed.size - seed.data_offset + len(seed.header_bytes())
    seed.cut = rng.choice(
        [0, 3, 8, 24, rng.randrange(24, seed.data_offset), rng.randrange(seed.data_offset, end), end - 1]
    )
    return "truncate"


def m_flip(seed: Seed, rng: random.Random) -> str:
    for _ in range(rng.choice([1, 4, 32])):
        seed.flips.append((rng.randrange(seed.data_offset), rng.randrange(256)))
    return "flip"


MUTATIONS: list[tuple[Callable[[Seed, random.Random], str], int]] = [
    (m_value, 8),
    (m_count_lie, 4),
    (m_string_lie, 3),
    (m_header_counts, 2),
    (m_version, 1),
    (m_tensor_dims, 5),
    (m_tensor_offset, 4),
    (m_tensor_type, 3),
    (m_tensor_name, 4),
    (m_block_count, 2),
    (m_sizes, 4),
    (m_special_ids, 3),
    (m_vocabulary, 4),
    (m_template, 3),
    (m_alignment, 2),
    (m_truncate, 3),
    (m_flip, 4),
]


def mutated_file(seed: Seed, rng: random.Random, out: Path) -> str:
    """Write one mutation (sometimes two) of `seed` to `out`; returns what was done, e.g. "offset:blk.3.attn_q"."""
    s = seed.copy()
    funcs, weights = zip(*MUTATIONS, strict=True)
    done = [rng.choices(funcs, weights)[0](s, rng) for _ in range(1 if rng.random() < 0.8 else 2)]
    s.write(out)
    return "+".join(done)
