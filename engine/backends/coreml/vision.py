"""The vision encoder's Core ML program (written by `coreml.vision`): its interface.

Input `patches` (1, 3 * p * p, 1, P) fp16: one normalised frame cut into its P patches of p x p pixels, each patch's
values in the patch embedding's own order (channel, row, column), channels-first as the ANE consumes them; cutting is
a reshape on the host (`frame_patches`), so the whole program is 1x1 convolutions, matrix products and norms.
Output `features` (1, C, 1, N): the frame's N image-token rows, channels-first (`rows` turns them into (N, C)).

The runtime loads it from `<cache key>/ENCODER_PACKAGE` in the conversion cache (engine.backends.coreml.vision_runtime);
it is not part of the text model's bundle.
"""

from __future__ import annotations

import numpy as np
import torch

ENCODER_INPUT = "patches"
ENCODER_OUTPUT = "features"
ENCODER_PACKAGE = "encoder.mlpackage"


def frame_patches(pixels: np.ndarray, patch: int) -> np.ndarray:
    """(3, S, S) -> (1, 3 * p * p, 1, P) fp16, patches in row-major order (the patch embedding's output order)."""
    c, s, _ = pixels.shape
    side = s // patch
    cut = pixels.reshape(c, side, patch, side, patch).transpose(0, 2, 4, 1, 3)  # (3, p, p, side, side)
    return np.ascontiguousarray(cut.reshape(1, c * patch * patch, 1, side * side), dtype=np.float16)


def rows(features: np.ndarray) -> torch.Tensor:
    """The program's (1, C, 1, N) output -> (N, C) float32."""
    return torch.from_numpy(np.ascontiguousarray(features[0, :, 0, :].T, dtype=np.float32))
