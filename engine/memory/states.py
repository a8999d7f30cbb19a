"""One entry point for what a `.spark` file (or an L3 snapshot) may say about a memory, whatever its kind: checked
in full before anything is allocated or written, so that a file that passes is a file that restores.

A file is hostile input. Everything here is pure validation over parsed JSON and decoded tensors: it raises
`SchemaError(what)` — a clause completing "The session file X ..." — and never allocates by a size the file chose.

Each memory checks its own state (FullAttentionMemory: engine.memory.base.check_full_state; the cascade:
engine.memory.cascade.state_schema); `session verify` and restore call `check_memory_state` here with the same
target, so verify OK implies restore succeeds. Without a model, `target_from_state` derives the target from the
file's own geometry (every check that does not need the model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.memory.base import check_full_state
from engine.memory.cascade.state_schema import check_cascade_state
from engine.memory.values import SchemaError, StateTarget, as_dict, cascade_config

__all__ = ["SchemaError", "StateTarget", "check_memory_state", "target_from_state"]


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
    if kind == "cascade":
        check_cascade_state(meta, tensors, target)
    else:
        check_full_state(meta, tensors, target)
