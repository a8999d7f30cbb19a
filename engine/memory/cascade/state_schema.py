"""The cascade memory's state (engine.memory.cascade.CascadeMemory.state()) checked in full against a `StateTarget`:
every field's type and range, and the invariants that tie them, so that a state that passes restores.

Adding a field to the cascade's state: add one line to `_check_cascade` (one place per field).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from engine.memory.cascade.episodic import ADOPTED_BASE
from engine.memory.values import (
    KV_DTYPE,
    L3_KEY,
    MAX_COUNT,
    MAX_GEOMETRY,
    SchemaError,
    StateTarget,
    as_bool,
    as_dict,
    as_int,
    as_list,
    bad,
    cascade_config,
    check_tensor,
    counters,
    exact_names,
    memory_kind,
    tokens_in_vocab,
)

if TYPE_CHECKING:
    from engine.memory.cascade.config import CascadeConfig

CASCADE_STATE_VERSION = 2


def check_cascade_state(meta: Any, tensors: Mapping[str, torch.Tensor], target: StateTarget) -> None:
    """engine.memory.cascade.CascadeMemory.state(): every field's type and range, and the invariants that tie them.
    A version-1 state is checked as written, then migrated (engine.memory.cascade.migrate) and checked as version 2."""
    meta = memory_kind(meta, "cascade", target.cascade is not None)
    version = as_int(meta.get("version"), "version", 0, 2**16)
    if version == 1:
        _check_cascade(meta, tensors, target, 1)
        from engine.errors import SessionFileError
        from engine.memory.cascade.migrate import migrate_state

        try:
            meta, tensors = migrate_state(meta, dict(tensors))
        except SessionFileError:
            raise SchemaError("holds a version-1 cascade memory that cannot be migrated") from None
    elif version != CASCADE_STATE_VERSION:
        raise SchemaError("holds a cascade memory of a version this build cannot restore")
    _check_cascade(meta, tensors, target, CASCADE_STATE_VERSION)


def _saved_geometry(config: dict[str, Any], target: StateTarget) -> CascadeConfig:
    """The geometry a state was saved in: this memory's, or another within the model's trained context (an older
    default, another cascade.json), which the memory then lays itself out in. Budgets never decide."""
    cfg = target.cascade
    assert cfg is not None
    saved = cascade_config(config)
    if saved.same_state(cfg):  # budgets are per machine and never decide compatibility
        return cfg
    if target.max_positions is None or saved.window < 1 or saved.used_slots > target.max_positions:
        raise SchemaError("holds a memory of a cascade geometry this model cannot hold (beyond its trained context)")
    return saved


def _check_cascade(
    meta: dict[str, Any], tensors: Mapping[str, torch.Tensor], target: StateTarget, version: int
) -> None:
    """A cascade state as `version` wrote it. Version 2 (per-layer retrieval groups, per-block key bounds,
    query-summary routing) differs from 1 only where `_groups`, `_routing_tensors` and the block summaries say."""
    config = dict(as_dict(meta.get("config"), "config"))
    rep_keys = as_int(config.pop("rep_keys", 4), "config.rep_keys", 1, MAX_GEOMETRY) if version == 1 else 0
    cfg = _saved_geometry(config, target)
    sinks, window, block, groups_n = cfg.sink_tokens, cfg.window, cfg.block_size, cfg.retrieval_blocks
    slots = cfg.num_slots
    L, hkv, d = target.kv_dims

    tokens = tokens_in_vocab(meta.get("tokens"), "tokens", target.vocab_size, MAX_COUNT)
    n = len(tokens)

    w = as_dict(meta.get("working"), "working")
    n_sink = as_int(w.get("n_sink"), "working.n_sink", 0, sinks)
    n_window = as_int(w.get("n_window"), "working.n_window", 0, window)
    head = as_int(w.get("head"), "working.head", 0, window - 1)
    evicted = as_int(w.get("evicted"), "working.evicted", 0, MAX_COUNT)
    # Every token fed went to a sink or the window; the ring fills sinks first and is full before it evicts
    # (a memory with pictures may have let one leave whole since: engine.memory.cascade.pictures).
    pictures = _pictures(meta["pictures"], n) if "pictures" in meta else False
    if n_sink + n_window + evicted != n:
        raise bad("working memory", f"accounts for {n_sink + n_window + evicted} tokens, not the {n} it holds")
    if (
        (n_sink < sinks and (n_window or evicted))
        or (evicted and n_window != window and not pictures)
        or head != (n_window + evicted) % window
    ):
        raise bad("working memory", "is inconsistent (sinks, window fill, ring head)")

    e = as_dict(meta.get("episodic"), "episodic")
    partial_n = as_int(e.get("partial_n"), "episodic.partial_n", 0, block - 1)
    next_id = as_int(e.get("next_id"), "episodic.next_id", 0, MAX_COUNT)
    if next_id * block + partial_n != (evicted if groups_n else 0):  # evicted tokens go to episodic blocks in order
        raise bad("episodic memory", "does not match the tokens that left the window")
    tick = as_int(e.get("tick"), "episodic.tick", 0, MAX_COUNT)
    rows = as_int(e.get("rows"), "episodic.rows", 0, MAX_GEOMETRY)
    free_rows = as_list(e.get("free_rows"), "episodic.free_rows", rows)
    used_rows: set[int] = set()
    for r in free_rows:
        used_rows.add(as_int(r, "episodic.free_rows", 0, rows - 1))
    if len(used_rows) != len(free_rows):
        raise bad("episodic.free_rows", "repeats a row")
    resident_ids: list[int] = []
    block_ids: set[int] = set()
    for entry in as_list(e.get("blocks"), "episodic.blocks", rows):
        if not isinstance(entry, list) or len(entry) != 6:
            raise bad("episodic.blocks", "has an entry that is not [id, row, l3_key, last_access, uses, resident]")
        bid = block_id(entry[0], "episodic block id", next_id)
        row = as_int(entry[1], "episodic block row", 0, rows - 1)
        l3_key = entry[2]
        if l3_key is not None and not (isinstance(l3_key, str) and L3_KEY.fullmatch(l3_key)):
            raise bad("episodic block's l3_key", "is not a content hash")
        as_int(entry[3], "episodic block's last access", 0, tick)
        as_int(entry[4], "episodic block's uses", 0, MAX_COUNT)
        if not as_bool(entry[5], "episodic block's resident flag") and l3_key is None:
            raise bad("episodic memory", "has a spilled block with nowhere to page it in from")
        if bid in block_ids or row in used_rows:
            raise bad("episodic.blocks", "repeats a block or a row")
        block_ids.add(bid)
        used_rows.add(row)
        if entry[5]:
            resident_ids.append(bid)
    if len(used_rows) != rows:
        raise bad("episodic memory", "leaves rows neither used nor free")
    counters(e.get("counters"), "episodic.counters")

    _groups(w.get("groups"), version, L, groups_n, next_id)

    r = as_dict(meta.get("routing"), "routing")
    as_int(r.get("since_route"), "routing.since_route", 0, MAX_COUNT)
    # Written until the state stopped carrying what it never read back; still checked where present.
    for flag in ("last_prefill", "last_evicted"):
        if flag in r:
            as_bool(r[flag], f"routing.{flag}")
    if "last_slots" in r:
        last_slots = [
            as_int(s, "routing.last_slots", 0, slots - 1)
            for s in as_list(r["last_slots"], "routing.last_slots", window)
        ]
        if len(set(last_slots)) != len(last_slots):
            raise bad("routing.last_slots", "repeats a slot")

    p = as_dict(meta.get("prefix"), "prefix")
    prefix_open = as_bool(p.get("open"), "prefix.open")
    persisted = as_int(p.get("persisted"), "prefix.persisted", 0, n)
    if persisted % block or (prefix_open and evicted):
        raise bad("prefix", "is inconsistent with the tokens it holds")
    counters(meta.get("counters"), "counters")

    kv = (L, hkv, slots, d)
    check_tensor(tensors, "wk.k", KV_DTYPE, kv)
    check_tensor(tensors, "wk.v", KV_DTYPE, kv)
    check_tensor(tensors, "ep.partial_k", KV_DTYPE, (L, hkv, block, d))
    check_tensor(tensors, "ep.partial_v", KV_DTYPE, (L, hkv, block, d))
    # What each block is scored by: representative keys (1), per-channel key bounds (2).
    summaries = (
        {"ep.reps": (rows, rep_keys, L * hkv * d)}
        if version == 1
        else {"ep.kmin": (rows, L, hkv * d), "ep.kmax": (rows, L, hkv * d)}
    )
    for name, shape in summaries.items():
        check_tensor(tensors, name, torch.float32, shape)
    expected = {"wk.k", "wk.v", "ep.partial_k", "ep.partial_v", *summaries}
    for bid in resident_ids:
        for part in ("k", "v"):
            check_tensor(tensors, f"ep.{bid}.{part}", KV_DTYPE, (L, hkv, block, d))
            expected.add(f"ep.{bid}.{part}")
    expected |= _routing_tensors(r, tensors, version, (L, hkv, d))
    exact_names(tensors, expected)


def _pictures(value: Any, n: int) -> bool:
    """pictures: {"spans": [[start, end], ...] in order, not overlapping, within the n tokens; "open": null or
    [start, next index, count] of a picture being fed, after them}. True (a state names pictures)."""
    p = as_dict(value, "pictures")
    if set(p) != {"spans", "open"}:
        raise bad("pictures", "is not {spans, open}")
    last = 0
    for span in as_list(p["spans"], "pictures.spans", n):
        pair = as_list(span, "pictures.spans", 2)
        if len(pair) != 2:
            raise bad("pictures.spans", "has an entry that is not [start, end]")
        start = as_int(pair[0], "picture's start", last, n - 1)
        last = as_int(pair[1], "picture's end", start + 1, n)
    if p["open"] is not None:
        opened = as_list(p["open"], "pictures.open", 3)
        if len(opened) != 3:
            raise bad("pictures.open", "is not [start, next index, count]")
        start = as_int(opened[0], "open picture's start", last, n - 1)
        count = as_int(opened[2], "open picture's count", 2, MAX_COUNT)
        as_int(opened[1], "open picture's next index", 1, min(count - 1, n - start))
    return True


MAX_ADOPTED_BLOCKS = 1 << 32  # far beyond 32 attachments of engine.documents' largest


def block_id(value: Any, where: str, next_id: int) -> int:
    """A block of the conversation's own (below next_id) or an attached one's (engine.memory.cascade.episodic's
    ADOPTED_BASE on: documents and recalled conversations, engine.documents)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= ADOPTED_BASE:
        return as_int(value, where, ADOPTED_BASE, ADOPTED_BASE + MAX_ADOPTED_BLOCKS - 1)
    return as_int(value, where, 0, next_id - 1)


def _groups(value: Any, version: int, layers: int, groups_n: int, next_id: int) -> None:
    """working.groups: one list of R block ids or None shared by every layer (1); a list per layer (2)."""
    if version == 1:
        groups = as_list(value, "working.groups", groups_n)
        if len(groups) != groups_n:
            raise bad("working.groups", f"does not list the {groups_n} retrieval groups")
        held = [block_id(g, "working.groups", next_id) for g in groups if g is not None]
        if len(set(held)) != len(held):
            raise bad("working.groups", "holds a block twice")
        return
    per_layer = as_list(value, "working.groups", layers)
    if len(per_layer) != layers:
        raise bad("working.groups", f"does not list retrieval groups for each of the {layers} layers")
    sizes = set()
    for layer in per_layer:  # each layer's retrieval slots hold their own blocks, as many in every layer
        held = [block_id(g, "working.groups", next_id) for g in as_list(layer, "working.groups", groups_n)]
        if len(set(held)) != len(held):
            raise bad("working.groups", "holds a block twice in one layer")
        sizes.add(len(held))
    if len(sizes) > 1:
        raise bad("working.groups", "holds a different number of blocks in different layers")


def _routing_tensors(
    r: dict[str, Any], tensors: Mapping[str, torch.Tensor], version: int, kv_dims: tuple[int, int, int]
) -> set[str]:
    """The routing state's tensors (their names): a float64 prompt-key sum (1); recent query summaries and the
    routed query (2)."""
    L, hkv, d = kv_dims
    names: set[str] = set()
    if version == 1:
        prompt_n = as_int(r.get("prompt_n"), "routing.prompt_n", 0, MAX_COUNT)
        if "route.prompt_sum" in tensors:
            check_tensor(tensors, "route.prompt_sum", torch.float64, (L, hkv, d))
            names.add("route.prompt_sum")
        elif prompt_n:
            raise SchemaError("lacks the routing tensor 'route.prompt_sum' its prompt count needs")
        return names
    counts = [
        as_int(c, "routing.recent_tokens", 1, MAX_COUNT)
        for c in as_list(r.get("recent_tokens"), "routing.recent_tokens", MAX_GEOMETRY)
    ]
    if counts:  # (n, L, Hkv*D) query summaries of the recent steps, one per count
        check_tensor(tensors, "route.recent", torch.float32, (len(counts), L, hkv * d))
        names.add("route.recent")
    if "route.routed" in tensors:
        check_tensor(tensors, "route.routed", torch.float32, (L, hkv, d))
        names.add("route.routed")
    return names
