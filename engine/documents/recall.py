"""An earlier conversation recalled from the memory its full `.spark` file stores, without reading it again.

A full file holds the conversation's KV: the sinks and the window in the slot table, the evicted tokens as episodic
blocks (resident, or stubs whose KV is in the persistent store) and the partial block between them. It is
restored exactly as a load restores it (engine.session.file.restore: model fingerprint, tokenizer, keys/values type
and every value of the state checked) onto a slot table of its own, and its tokens after the sinks are cut into
blocks of the conversation's block size, oldest first; the last block ends at the conversation's last token (it
overlaps the one before when the tokens do not fill whole blocks), so nothing said last is lost. Each block goes
into the persistent store under its content address with its key bounds, as a capsule's blocks do
(engine.documents.capsule), and joins the conversation as pinned episodic stubs: `read_tokens` is 0.

The sinks are left out, as a capsule's reader leaves its own out: the model's attention sinks would outscore every
block for any question. Where the stored memory cannot serve (a compact file, another model or numerics, a block
no longer on disk, a conversation shorter than a block) the caller reads the transcript again, saying why.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.backends.base import Backend
from engine.documents.capsule import CAPSULE_VERSION, Capsule
from engine.documents.provenance import TokenMap
from engine.errors import SparkError
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import Memory
from engine.memory.cascade import CascadeMemory, PersistentStore
from engine.memory.cascade.episodic import blocks_key_bounds, content_digest
from engine.session.file import ForeignModelSession, Message, SessionData, restore


class _Compact(Exception):
    """The file holds a replay recipe, not KV: there is no stored memory to recall."""


class StoredMemoryUnusable(SparkError):
    """Why a full file's memory cannot be recalled here (one sentence); the transcript is read instead."""


def recall_stored(memory: CascadeMemory, tokenizer: Tokenizer, path: Path) -> tuple[Capsule, str] | None:
    """The conversation in `path` as a capsule of its stored memory, put into `memory`'s store with its index (the
    second item: its key, what a session file records); None for a compact file (nothing stored to recall).
    StoredMemoryUnusable when a full file's memory does not fit this model or is incomplete;
    engine.errors.SessionFileError for a damaged file."""
    store = memory.store
    if store is None:
        raise SparkError("Recalling needs the persistent cache; run without --no-prefix-cache.")
    fork = memory.backend.fork()
    try:
        outcome = restore(
            path,
            fork,
            lambda b: CascadeMemory(b, memory.cfg, store=store),
            tokenizer_hash=tokenizer.content_hash,
            recompute=_refuse,
        )
    except BaseException as exc:
        fork.release()
        if isinstance(exc, _Compact):
            return None
        raise
    try:
        if isinstance(outcome, ForeignModelSession):
            raise StoredMemoryUnusable(outcome.reason)
        numerics = outcome.data.extra.get("numerics")
        if numerics is not None and numerics != fork.numerics:
            raise StoredMemoryUnusable(
                f"{path.name} was saved on other numerics ({numerics}); its memory would differ."
            )
        recalled = outcome.memory
        if not isinstance(recalled, CascadeMemory):
            raise StoredMemoryUnusable(f"{path.name} holds another kind of memory than the cascade's.")
        return _capsule(recalled, fork, store, tokenizer, outcome.data, path.name, memory.cfg.block_size)
    finally:
        fork.release()


def _refuse(memory: Memory, data: SessionData) -> None:
    raise _Compact


def _capsule(
    recalled: CascadeMemory,
    fork: Backend,
    store: PersistentStore,
    tokenizer: Tokenizer,
    data: SessionData,
    name: str,
    b: int,
) -> tuple[Capsule, str]:
    """Blocks of `b` tokens (the recalling memory's block size: the file's geometry may be another)."""
    k, v, first = _tokens_kv(recalled, fork, name)  # (L, Hkv, n, D): tokens [first, first + n) in order
    n = k.shape[2]
    if n < b:
        raise StoredMemoryUnusable(f"{name} is shorter than one block of memory.")
    starts = list(range(0, n - b + 1, b))
    if starts[-1] + b < n:
        starts.append(n - b)  # the last tokens, overlapping the block before
    keys: list[str] = []
    kmins: list[torch.Tensor] = []
    kmaxs: list[torch.Tensor] = []
    order: list[int] = []  # the conversation's token index of each of the capsule's tokens
    disk = 0
    for s in starts:
        bk, bv = k[:, :, s : s + b].contiguous(), v[:, :, s : s + b].contiguous()
        lo, hi = blocks_key_bounds(bk, b)
        kmins.append(lo)
        kmaxs.append(hi)
        key = store.key(content_digest(bk, bv), "content")
        store.put(key, bk, bv, b)
        keys.append(key)
        disk += store.entry_bytes(key)
        order.extend(range(first + s, first + s + b))
    if store.disabled or any(key not in store for key in keys):
        raise SparkError(
            "The persistent cache could not keep this recalled conversation (its disk budget or the disk is full); "
            "raise the cache budget or recall less."
        )
    tokens = list(recalled.tokens)
    ids = [tokens[i] for i in order]
    token_map = _conversation_map(tokenizer, tokens, data.messages, order, name)
    capsule = Capsule(name, ids, b, keys, torch.cat(kmins), torch.cat(kmaxs), token_map, 0, disk)
    # Its index, as a read capsule's (engine.documents.capsule), under an address of its blocks' contents.
    index = store.key(hashlib.sha256("|".join(["recalled", *keys]).encode()).hexdigest(), "capsule")
    meta = {"version": CAPSULE_VERSION, "block_size": b, "ids": ids, "keys": keys, "map": token_map.to_json()}
    store.put_state(index, meta, {"kmin": capsule.kmin, "kmax": capsule.kmax})
    return capsule, index


def _tokens_kv(memory: CascadeMemory, fork: Backend, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """KV (L, Hkv, n, D) of every token after the sinks, oldest first, and the index of the first: the episodic
    blocks in order, the partial block, the window."""
    w, ep = memory.working, memory.episodic
    b = memory.cfg.block_size
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    for bid in range(w.evicted // b):
        if bid not in ep.blocks:
            raise StoredMemoryUnusable(f"Part of {name}'s memory was forgotten under its budget.")
        kv = ep.fetch(bid, protect=())
        if kv is None:
            raise StoredMemoryUnusable(f"Part of {name}'s memory is no longer on this disk.")
        ks.append(kv[0])
        vs.append(kv[1])
    if ep.partial_n:
        ks.append(ep.partial_k[:, :, : ep.partial_n].clone())
        vs.append(ep.partial_v[:, :, : ep.partial_n].clone())
    if w.n_window:
        slots = w.recent_slots(w.n_window).flip(0)  # (n_window,) oldest first
        wk, wv = fork.read_kv(memory.row, slots)
        ks.append(wk)
        vs.append(wv)
    if not ks:
        raise StoredMemoryUnusable(f"{name} holds no memory after its first tokens.")
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2), w.n_sink


def _conversation_map(
    tokenizer: Tokenizer, tokens: Sequence[int], messages: Sequence[Message], order: Sequence[int], name: str
) -> TokenMap:
    """Where each of the capsule's tokens came from: the line of the transcript, numbered as
    engine.documents.attach.transcript_document numbers it (each message's lines, one after another)."""
    pieces = [tokenizer.decode([t], skip_special=False) for t in tokens]
    offsets: list[int] = []  # character offset of each token in the decoded conversation
    at = 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    text = "".join(pieces)
    line_starts: list[int] = []  # token index where each transcript line begins
    found = 0
    for m in messages:
        for part in m.content.split("\n"):
            hit = text.find(part, found) if part.strip() else -1
            at_char = hit if hit >= 0 else found  # a line not found where expected starts where the last ended
            if hit >= 0:
                found = hit + len(part)
            line_starts.append(max(0, bisect.bisect_right(offsets, at_char) - 1))
    starts: list[int] = []
    where: list[tuple[int, int]] = []
    for pos, i in enumerate(order):
        line = max(1, bisect.bisect_right(line_starts, i)) if line_starts else 1
        if not where or where[-1] != (0, line):
            starts.append(pos)
            where.append((0, line))
    return TokenMap(name, tuple(starts), tuple(where))
