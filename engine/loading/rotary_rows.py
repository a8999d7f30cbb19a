"""Partial rotary (Phi-4-mini rotates 0.75 of each head): q/k rows reordered so the engine's full-width rotation
applies.

Transformers rotates the first R channels of a head with rotate-half pairing (i, i + R/2) and passes the rest
through; the engine's rotation (engine.model.attention.apply_rope, the native kernels, Core ML) pairs (i, i + D/2)
across the whole head. Attention scores are q·k summed over channels, so the same reordering of q's and k's rows
changes nothing; after it, the rotated pairs sit at (i, i + D/2) for i < R/2 and the pass-through channels fill
the pairs i >= R/2, which rotate by angle 0 (rope_inv_freq gives them frequency 0). V is not reordered.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from engine.errors import ModelLoadError

Rows = TypeVar("Rows", np.ndarray, torch.Tensor)


def partial_rotary_order(head_dim: int, rotary_dims: int) -> list[int]:
    """new channel j of a head <- old channel order[j] (see the module doc)."""
    half, r = head_dim // 2, rotary_dims // 2
    passed = list(range(rotary_dims, head_dim))  # D - R channels, split over the two halves
    return [*range(r), *passed[: half - r], *range(r, rotary_dims), *passed[half - r :]]


def reorder_rows(w: Rows, n_head: int, head_dim: int, rotary_dims: int, back: bool = False) -> Rows:
    """Rows (n_head*D, ...) of q or k (weights, biases, or rows of quantization blocks) in the engine's order
    (`back`: from the engine's order to transformers', as a GGUF keeps them)."""
    if w.shape[0] != n_head * head_dim or not 0 < rotary_dims <= head_dim:
        # Callers check shapes first; this guards the reshape itself against a file whose sizes disagree.
        raise ModelLoadError(
            f"A q or k projection holds {w.shape[0]} rows where {n_head} heads of {head_dim} channels need "
            f"{n_head * head_dim}; the model's files disagree with its configuration."
        )
    order = partial_rotary_order(head_dim, rotary_dims)
    if back:
        order = [order.index(j) for j in range(head_dim)]
    per_head = w.reshape(n_head, head_dim, *w.shape[1:])
    if isinstance(per_head, torch.Tensor):
        return per_head[:, torch.tensor(order)].reshape(w.shape)
    return np.ascontiguousarray(per_head[:, order]).reshape(w.shape)
