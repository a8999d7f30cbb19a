"""One schema for what a `.spark` file (or an L3 snapshot) may say about a memory: checked in full before anything
is allocated or written, so that a file that passes is a file that restores.

A file is hostile input. Everything here is pure validation over parsed JSON and decoded tensors: it raises
`SchemaError(what)` — a clause completing "The session file X ..." — and never allocates by a size the file chose.

`check_memory_state(meta, tensors, target)` checks one memory's `state()` against a `StateTarget`: what the model
and its cascade geometry allow (vocabulary, KV dims, slots). `session verify` and `restore` call the same function
with the same target, so verify OK implies restore succeeds; without a model, `target_from_state` derives the
target from the file's own geometry (every check that does not need the model).

Adding a field to a memory's state: add one line to its checker below (one place per field).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from engine.sampling import InvalidSamplingSettings, SamplingSettings

if TYPE_CHECKING:  # engine.cascade imports this module (its memories check their own states)
    from engine.cascade.config import CascadeConfig

CASCADE_STATE_VERSION = 2
MAX_COUNT = 2**62  # counters, ticks, uses: far beyond any real run, small enough for every int64 tensor
MAX_GEOMETRY = 2**20  # any cascade size setting (slots, window, block): a million tokens of slot table
MAX_BUDGET = 2**50
L3_KEY = re.compile(r"[0-9a-f]{64}")  # sha256 hex: what PersistentStore.key produces, nothing else is a key
_KV_DTYPE = torch.float16


class SchemaError(ValueError):
    """A value of a session file is malformed; `str()` completes "The session file X ..."."""


@dataclass(frozen=True)
class StateTarget:
    """What a memory state must fit: the model's dims and, for a cascade, its geometry."""

    vocab_size: int
    kv_dims: tuple[int, int, int]  # (L, Hkv, D)
    cascade: CascadeConfig | None = None  # the memory's geometry (budgets excepted: they never decide compatibility)
    max_slots: int | None = None  # full-attention memory: the slot table size
    max_positions: int | None = None  # the model's trained context: bounds a saved geometry other than the memory's


# -- primitives ----------------------------------------------------------------------------------------------------


def _bad(where: str, why: str = "is malformed") -> SchemaError:
    return SchemaError(f"has a memory state whose {where} {why}")


def as_int(value: Any, where: str, lo: int, hi: int) -> int:
    # bool is an int in Python; a count that is `true` is still malformed.
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(where, f"is not a whole number in [{lo}, {hi}]")
    return value


def as_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(where, "is not true or false")
    return value


def as_list(value: Any, where: str, max_len: int) -> list:
    if not isinstance(value, list) or len(value) > max_len:
        raise _bad(where, f"is not a list of at most {max_len} items")
    return value


def as_dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise _bad(where, "is not an object")
    return value


def tokens_in_vocab(value: Any, where: str, vocab: int, max_len: int) -> list[int]:
    ids = as_list(value, where, max_len)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise _bad(where, f"holds a token id outside the model's {vocab}-token vocabulary")
    return ids


def check_tensor(tensors: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise SchemaError(f"lacks the memory tensor {name!r}")
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise SchemaError(f"holds tensor {name!r} as {t.dtype} {tuple(t.shape)}, where this model needs {dtype} {shape}")
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        raise SchemaError(f"holds tensor {name!r} with NaN or infinite values")
    return t


def _exact_names(tensors: Mapping[str, torch.Tensor], expected: set[str]) -> None:
    extra = sorted(set(tensors) - expected)
    if extra:
        raise SchemaError(f"holds a tensor {extra[0]!r} its memory state does not use")


def _counters(value: Any, where: str) -> None:
    d = as_dict(value, where)
    for key in ("hits", "misses", "evictions"):
        as_int(d.get(key), f"{where}.{key}", 0, MAX_COUNT)


# -- targets -------------------------------------------------------------------------------------------------------


def cascade_config(value: Any) -> CascadeConfig:
    """The state's cascade settings, typed strictly (every size an int in range, routing a known name)."""
    from engine.cascade.config import CascadeConfig, CascadeConfigError

    d = as_dict(value, "config")
    for f in fields(CascadeConfig):
        v = d.get(f.name, ...)
        if v is ...:
            continue  # from_dict applies the default, as it does when loading cascade.json
        if f.name == "routing":
            if not isinstance(v, str):
                raise _bad("config.routing")
        else:
            as_int(v, f"config.{f.name}", 0, MAX_BUDGET if f.name.endswith("_bytes") else MAX_GEOMETRY)
    try:
        return CascadeConfig.from_dict(d)
    except CascadeConfigError:
        raise _bad("config", "is not a valid cascade geometry") from None


def target_from_state(meta: Any, tensors: Mapping[str, torch.Tensor]) -> StateTarget:
    """A target from the file itself (no model at hand): its own geometry and KV dims, any vocabulary that fits a
    token id. Everything but the model-dependent ranges is then checked as restore checks it."""
    meta = as_dict(meta, "memory")
    kind = meta.get("kind")
    kv = tensors.get("wk.k" if kind == "cascade" else "k")
    if kv is None or kv.ndim != 4:
        raise SchemaError("lacks its memory's KV tensors")
    dims = (int(kv.shape[0]), int(kv.shape[1]), int(kv.shape[3]))
    if kind == "cascade":
        config = {k: v for k, v in as_dict(meta.get("config"), "config").items() if k != "rep_keys"}  # format 1's
        return StateTarget(2**31, dims, cascade=cascade_config(config))
    return StateTarget(2**31, dims, max_slots=int(kv.shape[2]))


# -- memory states -------------------------------------------------------------------------------------------------


def check_memory_state(meta: Any, tensors: Mapping[str, torch.Tensor], target: StateTarget) -> None:
    """Raise SchemaError unless `meta, tensors` is a state a memory of `target` restores exactly."""
    meta = as_dict(meta, "memory")
    kind = meta.get("kind")
    if kind == "cascade" and target.cascade is not None:
        check_cascade_state(meta, tensors, target)
    elif kind == "full" and target.max_slots is not None:
        check_full_state(meta, tensors, target)
    else:
        raise SchemaError(f"holds a {kind!r} memory, which this model's memory cannot restore")


def check_full_state(meta: dict, tensors: Mapping[str, torch.Tensor], target: StateTarget) -> None:
    """engine.memory.FullAttentionMemory: tokens, and their KV (L, Hkv, n, D) fp16."""
    assert target.max_slots is not None
    tokens = tokens_in_vocab(meta.get("tokens"), "tokens", target.vocab_size, MAX_COUNT)
    if len(tokens) > target.max_slots:
        raise SchemaError(f"holds {len(tokens)} tokens, more than the {target.max_slots} slots of this full-attention memory")
    L, hkv, d = target.kv_dims
    for name in ("k", "v"):
        check_tensor(tensors, name, _KV_DTYPE, (L, hkv, len(tokens), d))
    _exact_names(tensors, {"k", "v"})


def _saved_geometry(config: dict, target: StateTarget) -> CascadeConfig:
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


def check_cascade_state(meta: dict, tensors: Mapping[str, torch.Tensor], target: StateTarget) -> None:
    """engine.cascade.CascadeMemory.state(): every field's type and range, and the invariants that tie them.
    A version-1 state is checked as written, then migrated (engine.cascade.migrate) and checked as version 2."""
    version = as_int(meta.get("version"), "version", 0, 2**16)
    if version == 1:
        _check_cascade(meta, tensors, target, 1)
        from engine.cascade.migrate import migrate_state
        from engine.errors import SessionFileError

        try:
            meta, tensors = migrate_state(meta, dict(tensors))
        except SessionFileError:
            raise SchemaError("holds a version-1 cascade memory that cannot be migrated") from None
    elif version != CASCADE_STATE_VERSION:
        raise SchemaError("holds a cascade memory of a version this build cannot restore")
    _check_cascade(meta, tensors, target, CASCADE_STATE_VERSION)


def _check_cascade(meta: dict, tensors: Mapping[str, torch.Tensor], target: StateTarget, version: int) -> None:
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
    # Every token fed went to a sink or the window; the ring fills sinks first and is full before it evicts.
    if n_sink + n_window + evicted != n:
        raise _bad("working memory", f"accounts for {n_sink + n_window + evicted} tokens, not the {n} it holds")
    if (n_sink < sinks and (n_window or evicted)) or (evicted and n_window != window) or head != (n_window + evicted) % window:
        raise _bad("working memory", "is inconsistent (sinks, window fill, ring head)")

    e = as_dict(meta.get("episodic"), "episodic")
    partial_n = as_int(e.get("partial_n"), "episodic.partial_n", 0, block - 1)
    next_id = as_int(e.get("next_id"), "episodic.next_id", 0, MAX_COUNT)
    if next_id * block + partial_n != (evicted if groups_n else 0):  # evicted tokens go to episodic blocks in order
        raise _bad("episodic memory", "does not match the tokens that left the window")
    tick = as_int(e.get("tick"), "episodic.tick", 0, MAX_COUNT)
    rows = as_int(e.get("rows"), "episodic.rows", 0, MAX_GEOMETRY)
    free_rows = as_list(e.get("free_rows"), "episodic.free_rows", rows)
    used_rows: set[int] = set()
    for r in free_rows:
        used_rows.add(as_int(r, "episodic.free_rows", 0, rows - 1))
    if len(used_rows) != len(free_rows):
        raise _bad("episodic.free_rows", "repeats a row")
    resident_ids: list[int] = []
    block_ids: set[int] = set()
    for entry in as_list(e.get("blocks"), "episodic.blocks", rows):
        if not isinstance(entry, list) or len(entry) != 6:
            raise _bad("episodic.blocks", "has an entry that is not [id, row, l3_key, last_access, uses, resident]")
        bid = as_int(entry[0], "episodic block id", 0, next_id - 1)
        row = as_int(entry[1], "episodic block row", 0, rows - 1)
        l3_key = entry[2]
        if l3_key is not None and not (isinstance(l3_key, str) and L3_KEY.fullmatch(l3_key)):
            raise _bad("episodic block's l3_key", "is not a content hash")
        as_int(entry[3], "episodic block's last access", 0, tick)
        as_int(entry[4], "episodic block's uses", 0, MAX_COUNT)
        if not as_bool(entry[5], "episodic block's resident flag") and l3_key is None:
            raise _bad("episodic memory", "has a spilled block with nowhere to page it in from")
        if bid in block_ids or row in used_rows:
            raise _bad("episodic.blocks", "repeats a block or a row")
        block_ids.add(bid)
        used_rows.add(row)
        if entry[5]:
            resident_ids.append(bid)
    if len(used_rows) != rows:
        raise _bad("episodic memory", "leaves rows neither used nor free")
    _counters(e.get("counters"), "episodic.counters")

    _groups(w.get("groups"), version, L, groups_n, next_id)

    r = as_dict(meta.get("routing"), "routing")
    as_int(r.get("since_route"), "routing.since_route", 0, MAX_COUNT)
    # Written until the state stopped carrying what it never read back; still checked where present.
    for flag in ("last_prefill", "last_evicted"):
        if flag in r:
            as_bool(r[flag], f"routing.{flag}")
    if "last_slots" in r:
        last_slots = [as_int(s, "routing.last_slots", 0, slots - 1) for s in as_list(r["last_slots"], "routing.last_slots", window)]
        if len(set(last_slots)) != len(last_slots):
            raise _bad("routing.last_slots", "repeats a slot")

    p = as_dict(meta.get("prefix"), "prefix")
    prefix_open = as_bool(p.get("open"), "prefix.open")
    persisted = as_int(p.get("persisted"), "prefix.persisted", 0, n)
    if persisted % block or (prefix_open and evicted):
        raise _bad("prefix", "is inconsistent with the tokens it holds")
    _counters(meta.get("counters"), "counters")

    kv = (L, hkv, slots, d)
    check_tensor(tensors, "wk.k", _KV_DTYPE, kv)
    check_tensor(tensors, "wk.v", _KV_DTYPE, kv)
    check_tensor(tensors, "ep.partial_k", _KV_DTYPE, (L, hkv, block, d))
    check_tensor(tensors, "ep.partial_v", _KV_DTYPE, (L, hkv, block, d))
    # What each block is scored by: representative keys (1), per-channel key bounds (2).
    summaries = {"ep.reps": (rows, rep_keys, L * hkv * d)} if version == 1 else {"ep.kmin": (rows, L, hkv * d), "ep.kmax": (rows, L, hkv * d)}
    for name, shape in summaries.items():
        check_tensor(tensors, name, torch.float32, shape)
    expected = {"wk.k", "wk.v", "ep.partial_k", "ep.partial_v", *summaries}
    for bid in resident_ids:
        for part in ("k", "v"):
            check_tensor(tensors, f"ep.{bid}.{part}", _KV_DTYPE, (L, hkv, block, d))
            expected.add(f"ep.{bid}.{part}")
    expected |= _routing_tensors(r, tensors, version, (L, hkv, d))
    _exact_names(tensors, expected)



def _groups(value: Any, version: int, layers: int, groups_n: int, next_id: int) -> None:
    """working.groups: one list of R block ids or None shared by every layer (1); a list per layer (2)."""
    if version == 1:
        groups = as_list(value, "working.groups", groups_n)
        if len(groups) != groups_n:
            raise _bad("working.groups", f"does not list the {groups_n} retrieval groups")
        held = [as_int(g, "working.groups", 0, next_id - 1) for g in groups if g is not None]
        if len(set(held)) != len(held):
            raise _bad("working.groups", "holds a block twice")
        return
    per_layer = as_list(value, "working.groups", layers)
    if len(per_layer) != layers:
        raise _bad("working.groups", f"does not list retrieval groups for each of the {layers} layers")
    sizes = set()
    for layer in per_layer:  # each layer's retrieval slots hold their own blocks, as many in every layer
        held = [as_int(g, "working.groups", 0, next_id - 1) for g in as_list(layer, "working.groups", groups_n)]
        if len(set(held)) != len(held):
            raise _bad("working.groups", "holds a block twice in one layer")
        sizes.add(len(held))
    if len(sizes) > 1:
        raise _bad("working.groups", "holds a different number of blocks in different layers")


def _routing_tensors(r: dict, tensors: Mapping[str, torch.Tensor], version: int, kv_dims: tuple[int, int, int]) -> set[str]:
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
    counts = [as_int(c, "routing.recent_tokens", 1, MAX_COUNT) for c in as_list(r.get("recent_tokens"), "routing.recent_tokens", MAX_GEOMETRY)]
    if counts:  # (n, L, Hkv*D) query summaries of the recent steps, one per count
        check_tensor(tensors, "route.recent", torch.float32, (len(counts), L, hkv * d))
        names.add("route.recent")
    if "route.routed" in tensors:
        check_tensor(tensors, "route.routed", torch.float32, (L, hkv, d))
        names.add("route.routed")
    return names


def finite_number(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (bools, NaN, ints too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


# -- session metadata ----------------------------------------------------------------------------------------------

MAX_TOKEN_ID = 2**31 - 1
MAX_DEPTH = 32  # the deepest a session's JSON nests is ~5; deeper is a hostile file
MAX_TEXT = 64 * 1024 * 1024
MAX_ID_CHARS = 256  # versions, fingerprints, hashes
LATEST_TIME = 253402300799.0  # 9999-12-31: any later timestamp cannot be shown as a date
SAMPLER_STATE_BYTES = len(torch.Generator().get_state())  # the CPU generator's state (engine.sampling)


def check_json_values(meta: Any) -> None:
    """Every value of the parsed metadata: nesting bounded, strings that encode as UTF-8 (no lone surrogates),
    numbers finite (the parser already refused NaN and Infinity; a huge exponent parses to inf)."""
    stack: list[tuple[Any, int]] = [(meta, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise SchemaError(f"has metadata nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, str):
            _encodable(value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise SchemaError("has a number that is not finite")
        elif isinstance(value, dict):
            for k, v in value.items():
                _encodable(k)
                stack.append((v, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError("has text that is not valid Unicode (a lone surrogate)") from None


def _meta_field(meta: Mapping[str, Any], key: str, kind: type) -> Any:
    value = meta.get(key, ...)
    if value is ... or not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise SchemaError(f"has a missing or malformed {key!r} field")
    return value


def _short_text(meta: Mapping[str, Any], key: str, optional: bool = False) -> str | None:
    value = meta.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > MAX_ID_CHARS:
        raise SchemaError(f"has a missing or malformed {key!r} field")
    return value


def timestamp(value: Any, what: str) -> float:
    t = finite_number(value)
    if t is None or not 0.0 <= t <= LATEST_TIME:
        raise SchemaError(f"has a malformed {what}")
    return t


def token_id(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKEN_ID:
        raise SchemaError(f"has a malformed {key!r} field")
    return value


def check_sampling(settings: dict[str, Any]) -> None:
    """settings["sampling"], when present: exactly SamplingSettings' fields, each of its type and range."""
    sampling = settings.get("sampling")
    if sampling is None:
        return
    if not isinstance(sampling, dict):
        raise SchemaError("has malformed sampling settings")
    kinds = {f.name: f.type for f in fields(SamplingSettings)}
    for key, value in sampling.items():
        kind = kinds.get(key)
        ok = (
            kind is not None
            and (
                (kind == "float" and finite_number(value) is not None)
                or (kind == "int" and not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= MAX_TOKEN_ID)
                or (kind == "bool" and isinstance(value, bool))
                or (key == "seed" and (value is None or (not isinstance(value, bool) and isinstance(value, int) and 0 <= value < 2**64)))
            )
        )
        if not ok:
            raise SchemaError(f"has a malformed sampling setting {key!r}")
    try:
        SamplingSettings(**sampling).validate()
    except InvalidSamplingSettings:
        raise SchemaError("has sampling settings out of range") from None


def check_sampler_state(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list) or len(value) != SAMPLER_STATE_BYTES or any(type(b) is not int or not 0 <= b <= 255 for b in value):
        raise SchemaError("has a malformed sampler state")
    try:  # the generator's own checks, on a scratch generator: what restore's set_state will do
        torch.Generator().set_state(torch.tensor(value, dtype=torch.uint8))
    except (RuntimeError, ValueError):
        raise SchemaError("has a damaged sampler state") from None


def check_session_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The current-version metadata checked field by field -> SessionData's fields (minus tensors; messages as
    (role, content, timestamp) tuples). One line per field."""
    check_json_values(meta)
    messages = []
    for m in _meta_field(meta, "messages", list):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SchemaError("has a malformed message")
        ts = m.get("timestamp")
        messages.append((m["role"], m["content"], None if ts is None else timestamp(ts, "message timestamp")))
    system_prompt = meta.get("system_prompt")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise SchemaError("has a malformed 'system_prompt' field")
    settings = _meta_field(meta, "settings", dict)
    check_sampling(settings)
    check_sampler_state(meta.get("sampler_state"))
    extra = _meta_field(meta, "extra", dict)
    if not isinstance(extra.get("known_text", ""), str):
        raise SchemaError("has a malformed 'extra.known_text' field")
    pending = meta.get("pending_token")
    return {
        "app_version": _short_text(meta, "app_version"),
        "fingerprint": _short_text(meta, "model_fingerprint"),
        "tokenizer_hash": _short_text(meta, "tokenizer_hash", optional=True),
        "created": timestamp(meta.get("created"), "'created' time"),
        "saved": timestamp(meta.get("saved"), "'saved' time"),
        "system_prompt": system_prompt,
        "messages": messages,
        "settings": settings,
        "token_ids": [token_id(t, "token_ids") for t in _meta_field(meta, "token_ids", list)],
        "pending_token": None if pending is None else token_id(pending, "pending_token"),
        "sampler_state": meta.get("sampler_state"),
        "memory_meta": _meta_field(meta, "memory", dict),
        "extra": extra,
    }


def check_vocab(token_ids: list[int], pending: int | None, vocab: int) -> None:
    if any(t >= vocab for t in token_ids) or (pending is not None and pending >= vocab):
        raise SchemaError(f"holds token ids beyond this model's {vocab}-token vocabulary")
