"""Typed reads of a hostile file's values for the memories' state schemas (engine.memory.states): each raises `SchemaError(what)` — a clause
completing "The session file X ..." — and none allocates by a size the file chose.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the cascade's package imports this module (its memory checks its own state)
    from engine.memory.cascade.config import CascadeConfig

MAX_COUNT = 2**62  # counters, ticks, uses: far beyond any real run, small enough for every int64 tensor
MAX_GEOMETRY = 2**20  # any cascade size setting (slots, window, block): a million tokens of slot table
MAX_BUDGET = 2**50
L3_KEY = re.compile(r"[0-9a-f]{64}")  # sha256 hex: what PersistentStore.key produces, nothing else is a key
KV_DTYPE = torch.float16


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


def memory_kind(meta: Any, kind: str, target_ok: bool = True) -> dict[str, Any]:
    """`meta` as a dict whose "kind" is `kind` (and `target_ok`: the target describes such a memory)."""
    checked = as_dict(meta, "memory")
    if checked.get("kind") != kind or not target_ok:
        raise SchemaError(f"holds a {checked.get('kind')!r} memory, which this model's memory cannot restore")
    return checked


def bad(where: str, why: str = "is malformed") -> SchemaError:
    return SchemaError(f"has a memory state whose {where} {why}")


def as_int(value: Any, where: str, lo: int, hi: int) -> int:
    # bool is an int in Python; a count that is `true` is still malformed.
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad(where, f"is not a whole number in [{lo}, {hi}]")
    return value


def as_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise bad(where, "is not true or false")
    return value


def as_list(value: Any, where: str, max_len: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > max_len:
        raise bad(where, f"is not a list of at most {max_len} items")
    return value


def as_dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(where, "is not an object")
    return value


def tokens_in_vocab(value: Any, where: str, vocab: int, max_len: int) -> list[int]:
    ids = as_list(value, where, max_len)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise bad(where, f"holds a token id outside the model's {vocab}-token vocabulary")
    return ids


def check_tensor(
    tensors: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise SchemaError(f"lacks the memory tensor {name!r}")
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise SchemaError(
            f"holds tensor {name!r} as {t.dtype} {tuple(t.shape)}, where this model needs {dtype} {shape}"
        )
    # A "meta" tensor is a shape without values (a block paged in later, engine.session.kept, checked then).
    if t.is_floating_point() and t.numel() and t.device.type != "meta" and not all_finite(t):
        raise SchemaError(f"holds tensor {name!r} with NaN or infinite values")
    return t


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in `t`. fp16 (the KV of every saved memory) is summed in fp32 instead, about 3x faster on a
    large state: no sum of fp16 values (at most 65,504 each) can overflow fp32, so it is finite exactly when every
    value is."""
    if t.dtype == torch.float16:
        return bool(torch.isfinite(t.sum(dtype=torch.float32)))
    return bool(torch.isfinite(t).all())


def exact_names(tensors: Mapping[str, torch.Tensor], expected: set[str]) -> None:
    extra = sorted(set(tensors) - expected)
    if extra:
        raise SchemaError(f"holds a tensor {extra[0]!r} its memory state does not use")


def counters(value: Any, where: str) -> None:
    d = as_dict(value, where)
    for key in ("hits", "misses", "evictions"):
        as_int(d.get(key), f"{where}.{key}", 0, MAX_COUNT)


# -- geometry ------------------------------------------------------------------------------------------------------


def cascade_config(value: Any) -> CascadeConfig:
    """The state's cascade settings, typed strictly (every size an int in range, routing a known name)."""
    from engine.memory.cascade.config import CascadeConfig, CascadeConfigError

    d = as_dict(value, "config")
    for f in fields(CascadeConfig):
        v = d.get(f.name, ...)
        if v is ...:
            continue  # from_dict applies the default, as it does when loading cascade.json
        if f.name == "routing":
            if not isinstance(v, str):
                raise bad("config.routing")
        else:
            as_int(v, f"config.{f.name}", 0, MAX_BUDGET if f.name.endswith("_bytes") else MAX_GEOMETRY)
    try:
        return CascadeConfig.from_dict(d)
    except CascadeConfigError:
        raise bad("config", "is not a valid cascade geometry") from None


def finite_number(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (bools, NaN, ints too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None
