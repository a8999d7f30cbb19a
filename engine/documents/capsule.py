"""A capsule: a text read through the model once, kept as episodic blocks any conversation can attach.

Reading: the text's token ids go through the model in chunks on a slot table of their own (a fork of the
conversation's backend), each token seeing the sinks and the READ_WINDOW tokens before it; every chunk's keys and
values are read back as soon as its forward is done, cut into blocks of the conversation's block size, and each
block stored in the persistent tier (L3) as an ordinary "kv" entry under its content address, with its key bounds
(the same Quest bounds the episodic tier routes by). Keys are stored unrotated (engine.backends.base.read_kv),
so a block can sit at any position of the conversation that pages it in.

The capsule's index (block keys, key bounds, token ids, the token map back to file, page and line) is one "state"
entry of the same store, under sha256(model fingerprint, numerics, dtype, the reading's settings, the token ids):
the second question, and every other conversation attaching the same text, finds it and reads nothing. An index
that does not check out (another geometry, a missing block, a damaged entry) is discarded and the text read again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.backends.base import Backend
from engine.documents.provenance import Citation, TokenMap
from engine.errors import SparkError
from engine.loading.tokenizer import Tokenizer
from engine.memory.cascade import CascadeConfig, CascadeMemory, PersistentStore
from engine.memory.cascade.episodic import blocks_key_bounds, content_digest

CAPSULE_VERSION = 1
READ_WINDOW = 1024  # what each token of a capsule sees while it is read (besides the sinks): the cost is linear
READ_CHUNK = 256
READ_SINKS = 4
READ_LEAD = 32  # pad tokens read first and dropped: the reader's sinks and the start of its window
MAX_CAPSULE_TOKENS = 1 << 20


@dataclass(frozen=True)
class Capsule:
    name: str  # the file or conversation it was read from
    ids: list[int]  # the token ids read (padded to whole blocks)
    block_size: int
    keys: list[str]  # block j's KV entry in L3: tokens [j * block_size, (j + 1) * block_size)
    kmin: torch.Tensor  # (n, L, F) float32: each block's key bounds
    kmax: torch.Tensor
    token_map: TokenMap
    read_tokens: int  # tokens the model computed to get it now (0: found on disk)
    disk_bytes: int  # what its entries take in L3

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def cite(self, block: int, tok: Tokenizer) -> Citation:
        """Block `block`'s lines and text."""
        b = self.block_size
        text = tok.decode(self.ids[block * b : (block + 1) * b]).strip()
        return self.token_map.cite(block * b, (block + 1) * b, text)


def capsule_key(store: PersistentStore, ids: list[int], block_size: int, pad: int) -> str:
    h = hashlib.sha256(f"capsule/{CAPSULE_VERSION}/{READ_SINKS}/{READ_LEAD}/{READ_WINDOW}/{block_size}/{pad}/".encode())
    h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return store.key(h.hexdigest(), "capsule")


def load_or_read(
    backend: Backend,
    store: PersistentStore,
    ids: list[int],
    token_map: TokenMap,
    block_size: int,
    pad: int,
    on_progress: Callable[[int, int], None] | None = None,
) -> Capsule:
    """The capsule of `ids` (padded with token `pad` to whole blocks): from the store when it holds a sound one,
    else read through the model now and stored."""
    if len(ids) > MAX_CAPSULE_TOKENS:
        raise SparkError(
            f"{token_map.source} is {len(ids):,} tokens, more than the {MAX_CAPSULE_TOKENS:,} one attachment may be."
        )
    ids = ids + [pad] * (-len(ids) % block_size)
    key = capsule_key(store, ids, block_size, pad)
    got = store.get_state(key)
    if got is not None:
        found = checked(got[0], got[1], store, ids, block_size, backend, token_map)
        if found is not None:
            return found
        store.discard(key)
    capsule = read(backend, store, ids, token_map, block_size, pad, on_progress)
    meta = {"version": CAPSULE_VERSION, "block_size": block_size, "ids": ids, "keys": capsule.keys,
            "map": token_map.to_json()}  # fmt: skip
    store.put_state(key, meta, {"kmin": capsule.kmin, "kmax": capsule.kmax})
    return capsule


def checked(
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    store: PersistentStore,
    ids: list[int],
    block_size: int,
    backend: Backend,
    token_map: TokenMap,
) -> Capsule | None:
    """A stored capsule (`store.get_state`'s meta and tensors) when every part of it holds for `ids` and
    `backend`'s geometry (and every block is still in L3), else None."""
    c = backend.config
    shape = (c.num_hidden_layers, c.num_key_value_heads * c.head_dim)
    keys = meta.get("keys")
    n = len(ids) // block_size
    if (
        meta.get("version") != CAPSULE_VERSION
        or meta.get("block_size") != block_size
        or meta.get("ids") != ids
        or not isinstance(keys, list)
        or len(keys) != n
        or any(not isinstance(k, str) or k not in store for k in keys)
    ):
        return None
    kmin, kmax = tensors.get("kmin"), tensors.get("kmax")
    if kmin is None or kmax is None or tuple(kmin.shape) != (n, *shape) or tuple(kmax.shape) != (n, *shape):
        return None
    try:
        stored_map = TokenMap.from_json(token_map.source, meta.get("map"))
    except ValueError:
        return None
    disk = sum(store.entry_bytes(k) for k in keys)
    return Capsule(token_map.source, ids, block_size, list(keys), kmin.float().clone(), kmax.float().clone(),
                   stored_map, 0, disk)  # fmt: skip


def read(
    backend: Backend,
    store: PersistentStore,
    ids: list[int],
    token_map: TokenMap,
    block_size: int,
    pad: int,
    on_progress: Callable[[int, int], None] | None = None,
) -> Capsule:
    """Read `ids` (whole blocks) through the model on a slot table of its own; each block stored in `store`.
    READ_SINKS `pad` tokens go first and are not kept: the model's attention sinks (the first tokens, whose keys
    every later token leans on) would otherwise sit in block 0 and outscore every block for any question."""
    fork = backend.fork()
    cfg = CascadeConfig(sink_tokens=READ_SINKS, window=READ_WINDOW, block_size=block_size, retrieval_blocks=0)
    reader = CascadeMemory(fork, cfg)
    lead = [pad] * READ_LEAD
    fork.expect(reader.slots_after(len(lead) + len(ids)))
    skip = len(lead)
    keys: list[str] = []
    kmins: list[torch.Tensor] = []
    kmaxs: list[torch.Tensor] = []
    pending_k: list[torch.Tensor] = []
    pending_v: list[torch.Tensor] = []
    held = 0
    disk = 0
    feed = lead + ids
    for at in range(0, len(feed), READ_CHUNK):
        piece = feed[at : at + READ_CHUNK]
        plan = reader.plan(piece)
        fork.forward(torch.tensor([piece], dtype=torch.long), plan.as_batch(), last_only=True)
        reader.after_forward()
        k, v = fork.read_kv(0, plan.write_slots[skip:])  # (L, Hkv, t, D): the chunk's tokens, as the model wrote them
        pending_k.append(k)
        pending_v.append(v)
        held += len(piece) - skip
        skip = 0
        whole = held - held % block_size
        if whole:
            ks, vs = torch.cat(pending_k, dim=2), torch.cat(pending_v, dim=2)
            pending_k, pending_v = [ks[:, :, whole:]], [vs[:, :, whole:]]
            held -= whole
            lo, hi = blocks_key_bounds(ks[:, :, :whole], block_size)  # (n, L, F) each
            kmins.append(lo)
            kmaxs.append(hi)
            for j in range(whole // block_size):
                bk = ks[:, :, j * block_size : (j + 1) * block_size].contiguous()
                bv = vs[:, :, j * block_size : (j + 1) * block_size].contiguous()
                key = store.key(content_digest(bk, bv), "content")
                store.put(key, bk, bv, block_size)
                keys.append(key)
                disk += store.entry_bytes(key)
        if on_progress is not None:
            on_progress(min(at + READ_CHUNK, len(feed)) - len(lead), len(ids))
    fork.release()
    if store.disabled or any(k not in store for k in keys):
        raise SparkError(
            "The persistent cache could not keep this attachment (its disk budget or the disk is full); "
            "raise the cache budget or attach less."
        )
    return Capsule(token_map.source, ids, block_size, keys, torch.cat(kmins), torch.cat(kmaxs), token_map,
                   len(ids), disk)  # fmt: skip
