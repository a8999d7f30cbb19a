"""The vision encoder's Core ML program (written by `coreml.vision`), its interface and its runtime.

Input `patches` (1, 3 * p * p, 1, P) fp16: one normalised frame cut into its P patches of p x p pixels, each patch's
values in the patch embedding's own order (channel, row, column), channels-first as the ANE consumes them; cutting is
a reshape on the host (`frame_patches`), so the whole program is 1x1 convolutions, matrix products and norms.
Output `features` (1, C, 1, N): the frame's N image-token rows, channels-first (`EncoderProgram.rows` turns them
into (N, C)).

`CoreMLEncoder` runs the program through Core ML (coremltools' MLModel, on the Neural Engine by default), frame by
frame, as a tower's `forward` does: imported everywhere, it needs a Mac to run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

ENCODER_INPUT = "patches"
ENCODER_OUTPUT = "features"


def frame_patches(pixels: np.ndarray, patch: int) -> np.ndarray:
    """(3, S, S) -> (1, 3 * p * p, 1, P) fp16, patches in row-major order (the patch embedding's output order)."""
    c, s, _ = pixels.shape
    side = s // patch
    cut = pixels.reshape(c, side, patch, side, patch).transpose(0, 2, 4, 1, 3)  # (3, p, p, side, side)
    return np.ascontiguousarray(cut.reshape(1, c * patch * patch, 1, side * side), dtype=np.float16)


def rows(features: np.ndarray) -> torch.Tensor:
    """The program's (1, C, 1, N) output -> (N, C) float32."""
    return torch.from_numpy(np.ascontiguousarray(features[0, :, 0, :].T, dtype=np.float32))


class CoreMLEncoder:
    """A converted encoder program run by Core ML: frames (N, 3, S, S) -> rows (N * tokens a frame, C)."""

    def __init__(self, package: Path, patch: int, units: str = "CPU_AND_NE") -> None:
        import coremltools as ct

        self.patch = patch
        self.model: Any = ct.models.MLModel(str(package), compute_units=getattr(ct.ComputeUnit, units))

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        out = []
        for frame in pixels.detach().float().cpu().numpy():
            got = self.model.predict({ENCODER_INPUT: frame_patches(frame, self.patch)})
            out.append(rows(np.asarray(got[ENCODER_OUTPUT])))
        return torch.cat(out)
