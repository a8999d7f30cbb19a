"""A CPU backend whose query summary the test sets: it steers which blocks the cascade's layers retrieve."""

from __future__ import annotations

import torch

from engine.backends.torch_backend import TorchBackend


class SteeredBackend(TorchBackend):
    """A test double whose query summary is set by the test (None: the real one)."""

    steer: torch.Tensor | None = None  # (1, L, Hkv, D)

    def query_summary(self) -> torch.Tensor:
        return self.steer.clone() if self.steer is not None else super().query_summary()
