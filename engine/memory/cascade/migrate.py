"""Cascade state format migrations: a state saved by an older version becomes the current one, so old session
files keep restoring.

Version 1 -> 2 (query-aware per-layer retrieval):
- config: `rep_keys` is gone (blocks keep key bounds, not representative keys); `reroute_drift` is new (default).
- working: `groups` was one list of R block ids (or None) shared by every layer; it becomes one list per layer of
  the blocks in groups [0, n). Version 1 placed blocks at positions in their original order, version 2 at fixed
  group positions, so the retrieval groups restart empty: the next routing decision pages blocks back in.
- episodic: `ep.reps` (rows, r, F) representative keys become `ep.kmin`, `ep.kmax` (rows, L, F) key bounds,
  computed from each resident block's KV; stubs (blocks whose KV went to L3) cannot be bounded without their KV
  and are forgotten.
- routing: the float64 prompt-key sum (`route.prompt_sum`, `prompt_n`) gives way to recent query summaries,
  which start empty (routing uses the recent keys until the first forward).
Nothing is allocated from the file's numbers beyond what its own tensors already hold.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import SessionFileError
from engine.memory.cascade.episodic import key_bounds


def migrate_state(
    meta: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A version-1 cascade state (meta, tensors) as version 2. Raises SessionFileError when it is malformed."""
    try:
        return _v1_to_v2(meta, tensors)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError):
        raise SessionFileError("The saved memory (cascade format 1) is malformed and cannot be migrated.") from None


def _v1_to_v2(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    meta, tensors = dict(meta), dict(tensors)
    config = {k: v for k, v in meta["config"].items() if k != "rep_keys"}
    wk = tensors["wk.k"]  # (L, Hkv, S, D)
    layers, hkv, _, d = wk.shape
    working = dict(meta["working"])
    working["groups"] = [[] for _ in range(layers)]
    episodic = dict(meta["episodic"])
    rows = int(episodic["rows"])
    kmin = torch.zeros(rows, layers, hkv * d)  # (rows, L, F)
    kmax = torch.zeros(rows, layers, hkv * d)
    blocks, free = [], [int(r) for r in episodic["free_rows"]]
    for bid, row, l3_key, last, uses, resident in episodic["blocks"]:
        if not resident:
            free.append(int(row))
            continue
        kmin[int(row)], kmax[int(row)] = key_bounds(tensors[f"ep.{int(bid)}.k"])
        blocks.append([bid, row, l3_key, last, uses, resident])
    episodic.update(blocks=blocks, free_rows=free)
    tensors.pop("ep.reps", None)
    tensors.pop("route.prompt_sum", None)
    tensors.update({"ep.kmin": kmin, "ep.kmax": kmax})
    routing = {k: v for k, v in meta["routing"].items() if k != "prompt_n"}
    routing["recent_tokens"] = []
    meta.update(version=2, config=config, working=working, episodic=episodic, routing=routing)
    return meta, tensors
