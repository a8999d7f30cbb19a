"""One schema for what a `.spark` file (or an L3 snapshot) may say about a memory: checked in full before anything
is allocated or written, so that a file that passes is a file that restores.

A file is hostile input. Everything here is pure validation over parsed JSON and decoded tensors: it raises
`SchemaError(what)` — a clause completing "The session file X ..." — and never allocates by a size the file chose.

`check_memory_state(meta, tensors, target)` checks one memory's `state()` against a `StateTarget`: what the model
and its cascade geometry allow (vocabulary, KV dims, slots). `session verify` and `restore` call the same function
with the same target, so verify OK implies restore succeeds; without a model, `target_from_state` derives the
target from the file's own geometry (every check that does not need the model).

The checks live in: engine.session_schema_values (typed reads, `SchemaError`, `StateTarget`),
engine.session_schema_cascade (the cascade's state), engine.session_schema_meta (the file's other metadata);
the full-attention memory's state is checked here. Adding a field to a memory's state: add one line to its
checker (one place per field). This module is where callers import the schema from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.session_schema_cascade import CASCADE_STATE_VERSION, check_cascade_state
from engine.session_schema_meta import (
    LATEST_TIME,
    MAX_TOKEN_ID,
    check_json_values,
    check_session_meta,
    check_vocab,
)
from engine.session_schema_values import (
    KV_DTYPE,
    MAX_COUNT,
    SchemaError,
    StateTarget,
    as_dict,
    cascade_config,
    check_tensor,
    exact_names,
    tokens_in_vocab,
)

__all__ = [
    "CASCADE_STATE_VERSION",
    "LATEST_TIME",
    "MAX_TOKEN_ID",
    "SchemaError",
    "StateTarget",
    "cascade_config",
    "check_cascade_state",
    "check_full_state",
    "check_json_values",
    "check_memory_state",
    "check_session_meta",
    "check_vocab",
    "target_from_state",
]


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


def check_full_state(meta: dict[str, Any], tensors: Mapping[str, torch.Tensor], target: StateTarget) -> None:
    """engine.memory.FullAttentionMemory: tokens, and their KV (L, Hkv, n, D) fp16."""
    assert target.max_slots is not None
    tokens = tokens_in_vocab(meta.get("tokens"), "tokens", target.vocab_size, MAX_COUNT)
    if len(tokens) > target.max_slots:
        raise SchemaError(
            f"holds {len(tokens)} tokens, more than the {target.max_slots} slots of this full-attention memory"
        )
    L, hkv, d = target.kv_dims
    for name in ("k", "v"):
        check_tensor(tensors, name, KV_DTYPE, (L, hkv, len(tokens), d))
    exact_names(tensors, {"k", "v"})
