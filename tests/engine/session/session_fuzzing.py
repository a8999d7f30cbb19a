"""Shared by the session fuzz test (hypothesis) and `make fuzz` (tests/fuzz_sessions.py): a tiny model, a real
cascade conversation on it (episodic blocks, spilled stubs, a persistent store) saved as seed files, and
schema-aware mutations of them: any field of the metadata or the memory state set to a hostile value, a tensor
made NaN, reshaped or dropped, raw JSON tokens (Infinity, NaN, huge exponents, lone surrogates), and byte-level
damage. Mutations that touch the content are re-sealed with a correct checksum, so what is under test is the
schema behind it.

Every mutation takes a `random.Random`, so hypothesis (through `st.randoms()`) and the plain fuzz loop share them.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.backends.torch_backend import TorchBackend
from engine.memory.base import Memory
from engine.memory.cascade import CascadeConfig, CascadeMemory, PersistentStore
from engine.session.file import save_session
from tests.engine.memory.cascade.helpers import greedy, prefill, random_ids
from tests.engine.session.session_helpers import write_v2
from tests.helpers.tiny import make_tiny_model

CONFIG = CascadeConfig(sink_tokens=4, window=32, block_size=8, retrieval_blocks=2, episodic_budget_bytes=40_000)
PREAMBLE = 68

HOSTILE_VALUES: list[Any] = [
    -1,
    0,
    1,
    7,
    31,
    32,
    33,
    255,
    2**31 - 1,
    2**31,
    2**32,
    2**63,
    2**64,
    -(2**63),
    10**30,
    3 * 10**8,
    1.5,
    -0.0,
    1e308,
    True,
    False,
    None,
    "",
    "7",
    "../../../../tmp/evil",
    "../" * 20 + "abcd",
    "a" * 63 + "/",
    "\x1b]0;pwned\x07\x1b[2J",
    "\ud800",
    [],
    [0],
    [None],
    {},
    {"a": 1},
    [[[[]]]],
]
RAW_TOKENS = ["Infinity", "-Infinity", "NaN", "1e999", "-1e999", '"\\ud800"', "9" * 5000, "[" * 5000 + "]" * 5000]


class World:
    """A tiny model, a live cascade conversation on it, and valid session files of it (every codec)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = make_tiny_model(root / "model")
        backend = TorchBackend(self.model, "cpu")
        self.fingerprint = backend.fingerprint
        memory = CascadeMemory(backend, CONFIG, store=self.store("writer"))
        ids = random_ids(200)
        logits = prefill(backend, memory, ids, 16)
        out, _ = greedy(backend, memory, logits, 12)
        memory.spill()  # some blocks become stubs whose KV is in the store (l3_key paths)
        prefill(backend, memory, random_ids(40, seed=1), 16)
        meta, tensors = memory.state()
        # Low-entropy KV of the same shapes (any finite fp16 is a valid state), so zlib/lzma really compress.
        tensors = {
            n: (t.float().round().clamp(-2, 2).to(t.dtype) if t.dtype == torch.float16 else t)
            for n, t in tensors.items()
        }
        self.meta, self.tensors = meta, tensors
        self.files: dict[str, bytes] = {}
        for compression in ("none", "zlib", "lzma"):
            path = root / f"{compression}.spark"
            save_session(
                path,
                fingerprint=self.fingerprint,
                tokenizer_hash=None,
                messages=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}],
                system_prompt="Be brief.",
                settings={"sampling": {"temperature": 0.7, "seed": 3}},
                memory_state=(meta, tensors),
                pending_token=out[-1],
                sampler_state=torch.Generator().manual_seed(3).get_state().tolist(),
                extra={"known_text": "Hello"},
                compression=compression,
            )
            self.files[compression] = path.read_bytes()
        raw = self.files["none"]
        (meta_len,) = struct.unpack_from("<Q", raw, 12)
        self.file_meta: dict = json.loads(raw[PREAMBLE : PREAMBLE + meta_len])
        self.section = raw[PREAMBLE + meta_len :]

    def store(self, name: str) -> PersistentStore:
        return PersistentStore(self.root / "l3" / name, self.fingerprint, "cpu-fp32", 1 << 30)

    def factory(self, store: PersistentStore | None) -> Callable[[TorchBackend], Memory]:
        return lambda backend: CascadeMemory(backend, CONFIG, store=store)

    def backend(self) -> TorchBackend:
        return TorchBackend(self.model, "cpu")


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (containers and leaves)."""
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):  # the first few items of long lists (token ids) are enough
            out += _paths(v, (*prefix, i))
    return out


def _set(obj: Any, path: tuple, value: Any, delete: bool) -> None:
    for key in path[:-1]:
        obj = obj[key]
    if delete and isinstance(obj, dict):
        del obj[path[-1]]
    elif delete:
        obj.pop(path[-1])
    else:
        obj[path[-1]] = value


def mutate_meta(world: World, rng: random.Random) -> tuple[str, bytes, bytes]:
    """A metadata field (anywhere, the memory state included) set to a hostile value or deleted."""
    meta = json.loads(json.dumps(world.file_meta))
    path = rng.choice(_paths(meta))
    value = rng.choice(HOSTILE_VALUES)
    _set(meta, path, value, delete=rng.random() < 0.1)
    text = json.dumps(meta, ensure_ascii=False)
    if rng.random() < 0.3:  # a raw JSON token where a value was: what json.dumps would never write
        marker = "7777777"
        meta2 = json.loads(json.dumps(world.file_meta))
        _set(meta2, path, int(marker), delete=False)
        text = json.dumps(meta2, ensure_ascii=False).replace(marker, rng.choice(RAW_TOKENS), 1)
    return f"meta:{'.'.join(map(str, path[:3]))}", text.encode("utf-8", "surrogatepass"), world.section


def mutate_tensors(world: World, rng: random.Random) -> tuple[str, bytes, bytes]:
    """A memory tensor made non-finite, reshaped, retyped, dropped, or an unknown one added."""
    tensors = dict(st_load(world.section))
    name = rng.choice(sorted(tensors))
    op = rng.choice(["nan", "inf", "reshape", "dtype", "drop", "extra", "grow"])
    t = tensors[name]
    if op in ("nan", "inf") and t.is_floating_point() and t.numel():
        t = t.clone()
        t.view(-1)[rng.randrange(t.numel())] = float("nan") if op == "nan" else float("inf")
        tensors[name] = t
    elif op == "reshape" and t.ndim:
        tensors[name] = t.reshape(-1)
    elif op == "dtype":
        tensors[name] = t.to(rng.choice([torch.float32, torch.float16, torch.float64, torch.int64]))
    elif op == "drop":
        del tensors[name]
    elif op == "extra":
        tensors[rng.choice(["ep.999.k", "flags", "wk.x"])] = torch.zeros(2, dtype=torch.float16)
    else:
        tensors[name] = torch.cat([t, t]) if t.ndim else t
    meta = json.dumps(world.file_meta).encode()
    return f"tensor:{op}", meta, st_save(tensors)


def mutate_bytes(world: World, rng: random.Random) -> bytes:
    """Byte-level damage to a whole file (most of it is caught by the checksum)."""
    raw = bytearray(world.files[rng.choice(sorted(world.files))])
    op = rng.choice(["truncate", "flip", "inflate", "garbage"])
    if op == "truncate":
        return bytes(raw[: rng.randrange(len(raw))])
    if op == "flip":
        for _ in range(rng.randint(1, 6)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(raw)
    if op == "inflate":
        struct.pack_into(
            "<Q", raw, rng.choice([12, 20, 28]), rng.choice([0, 1, 2**31, 2**63, 2**64 - 1, rng.randrange(2**64)])
        )
        return bytes(raw)
    return b"SPARK\x00\x02\x00" + rng.randbytes(rng.randrange(512))


def mutated_file(world: World, rng: random.Random, path: Path) -> str:
    """Write one mutated file to `path`; returns what was done (for the report)."""
    kind = rng.random()
    if kind < 0.55:
        what, meta, section = mutate_meta(world, rng)
    elif kind < 0.85:
        what, meta, section = mutate_tensors(world, rng)
    else:
        path.write_bytes(mutate_bytes(world, rng))
        return "bytes"
    write_v2(path, meta, section)
    return what


class memory_cap:
    """Cap this process's address space at its current size + `extra` bytes while inside (Linux; elsewhere a
    no-op): an allocation a file chose fails with MemoryError instead of taking the machine down. The soft limit
    is lowered and restored; the hard limit is never touched."""

    def __init__(self, extra: int) -> None:
        self.extra = extra
        self.saved: tuple[int, int] | None = None

    def __enter__(self) -> Self:
        try:
            import resource

            with open("/proc/self/statm") as f:
                vm = int(f.read().split()[0]) * resource.getpagesize()
        except (ImportError, OSError, ValueError):
            return self
        self.saved = resource.getrlimit(resource.RLIMIT_AS)
        hard = self.saved[1]
        cap = vm + self.extra if hard == resource.RLIM_INFINITY else min(hard, vm + self.extra)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, self.saved)
