"""The vision tower on the backend that runs the text model: its device and dtype (CUDA, MPS), or on the CPU the
native kernels' block products for its linear layers where the text model's weights are block-quantized.

The tower's linears (q/k/v/out, fc1/fc2 of every layer, the connector's projection) take their weights as stored
where the caller has them (`dict[str, StoredTensor]` by Hugging Face name, an mmproj's): a block format runs as
stored on the kernels (its bytes copied, never dequantized and re-quantized), F16/BF16/F32 widen exactly to fp32 and
stay in PyTorch (the kernels have no float products). An HF folder's fp32 linears are quantized here to
`TOWER_BLOCKS` when the text model runs quantized on the kernels; on any other backend they stay in its dtype. The
patch embedding (a strided convolution), the positions, the LayerNorms and attention stay in PyTorch, where the
kernels have no op.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.backends.blocks import BlockWeights
from engine.backends.native import NativeKernels
from engine.backends.native.decoder import NativeBlockLinear
from engine.errors import ModelLoadError
from engine.model.quant import BLOCK, BlockType, StoredTensor, check_stored, quantize, scales_finite

# The block format an HF folder's fp32 tower is held in on the kernels, whatever the text model's: the most
# faithful fast type (llama.cpp's mmproj files are F16 or Q8_0 too; a 4-bit encoder loses visibly more).
TOWER_BLOCKS = BlockType.Q8_0
FLOAT_FORMATS: dict[str, np.dtype[np.generic]] = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16)}


@dataclass(frozen=True)
class TowerPlacement:
    """Where a tower runs: `device` and `dtype` for its PyTorch parts; `kernels` (CPU only) runs its linears' block
    products, fp32 linears quantized to `blocks` first (None: fp32 linears stay fp32)."""

    device: torch.device
    dtype: torch.dtype
    kernels: NativeKernels | None = None
    blocks: BlockType | None = None

    def __post_init__(self) -> None:
        if self.kernels is not None and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError("the native kernels run on the CPU in float32 only")

    def describe(self, native: int, linears: int) -> str:
        """One line for the backend's explanation: what runs the tower."""
        where = f"{self.device.type} {str(self.dtype).removeprefix('torch.')}"
        if self.kernels is None or not native:
            return f"vision encoder: PyTorch {where}"
        return f"vision encoder: {native} of {linears} linears on native {self.kernels.isa} kernels, the rest PyTorch {where}"


def tower_linears(tower: nn.Module) -> list[str]:
    """Module paths of the tower's linear layers, in order."""
    return [path for path, m in tower.named_modules() if isinstance(m, nn.Linear)]


def _stored_for(path: str, stored: Mapping[str, StoredTensor]) -> tuple[str, StoredTensor] | None:
    # A checkpoint names the tower under "model." (Idefics3's safetensors); the tower's own paths lack it.
    for name in (f"model.{path}.weight", f"{path}.weight"):
        if name in stored:
            return name, stored[name]
    return None


def _float_weight(name: str, t: StoredTensor) -> torch.Tensor:
    """A float-stored weight widened exactly to fp32 (N, K); ModelLoadError in one sentence when it does not fit."""
    n, k = t.shape
    if t.qtype == "BF16":
        raw = np.ascontiguousarray(t.data).view(np.uint16)
        if raw.size != n * k:
            raise ModelLoadError(f"The vision tensor {name} holds {raw.size} values, not the {n * k} its shape needs.")
        values = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        kind = FLOAT_FORMATS[t.qtype]
        data = np.ascontiguousarray(t.data)
        values = data.view(kind) if data.dtype == np.uint8 else data.astype(kind, copy=False)
        if values.size != n * k:
            raise ModelLoadError(
                f"The vision tensor {name} holds {values.size} values, not the {n * k} its shape needs."
            )
    w = torch.from_numpy(np.array(values.reshape(n, k), dtype=np.float32))
    if not bool(torch.isfinite(w).all()):
        raise ModelLoadError(f"The vision tensor {name} holds NaN or infinite values; the file is corrupt.")
    return w


def _block_weight(name: str, t: StoredTensor) -> BlockWeights:
    try:
        qtype = check_stored(t, name)
    except ValueError as exc:
        raise ModelLoadError(f"The vision weights do not fit: {exc}.") from None
    if not scales_finite(t):
        raise ModelLoadError(f"The vision tensor {name} holds NaN or infinite values; the file is corrupt.")
    copy = np.array(np.asarray(t.data, dtype=np.uint8).reshape(t.shape[0], -1), dtype=np.uint8)  # (N, row bytes)
    return BlockWeights(qtype, t.shape, torch.from_numpy(copy))


def _quantized(w: torch.Tensor, blocks: BlockType) -> BlockWeights:
    """An fp32 weight (N, K) in `blocks`, zero columns padding K to a multiple of 32 (zeros quantize exactly)."""
    k = w.shape[1]
    padded = np.pad(w.detach().float().numpy(), ((0, 0), (0, -k % BLOCK)))  # (N, K rounded up)
    return BlockWeights(blocks, (padded.shape[0], padded.shape[1]), torch.from_numpy(quantize(padded, blocks)), k)


def _as_linear(w: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
    return lin


def place_tower(tower: nn.Module, placement: TowerPlacement, stored: Mapping[str, StoredTensor] | None = None) -> str:
    """Move `tower` (fp32, its weights loaded) onto `placement`, in place: each linear from `stored` where it has
    the layer's weight, else from its own; returns the line `TowerPlacement.describe` writes. ModelLoadError in one
    sentence for a stored weight of the wrong shape, format or values."""
    paths = tower_linears(tower)
    native = 0
    for path in paths:
        parent_path, _, leaf = path.rpartition(".")
        parent = tower.get_submodule(parent_path) if parent_path else tower
        old = getattr(parent, leaf)
        assert isinstance(old, nn.Linear)
        found = _stored_for(path, stored) if stored else None
        name = found[0] if found else path
        weight: torch.Tensor | None = None
        block: BlockWeights | None = None
        if found is None:
            if placement.kernels is not None and placement.blocks is not None:
                block = _quantized(old.weight, placement.blocks)
            else:
                weight = old.weight.detach().float()
        elif found[1].qtype in (*FLOAT_FORMATS, "BF16"):
            weight = _float_weight(*found)
        elif found[1].qtype in BlockType.__members__:
            block = _block_weight(*found)
        else:
            raise ModelLoadError(
                f"The vision tensor {name} is stored as {found[1].qtype}, which MLoT Spark cannot run; "
                f"choose an F16, F32 or Q8_0 projector file."
            )
        if block is not None:
            got = (block.shape[0], block.inputs)
        else:
            assert weight is not None
            got = (weight.shape[0], weight.shape[1])
        if got != (old.out_features, old.in_features):
            raise ModelLoadError(
                f"The vision tensor {name} has shape {got} but the encoder's configuration implies "
                f"{(old.out_features, old.in_features)}; the projector file does not fit this model."
            )
        if block is not None and placement.kernels is not None:
            setattr(parent, leaf, NativeBlockLinear(placement.kernels, block, old.bias))
            native += 1
        else:  # fp32 in PyTorch (a block weight dequantized once its shape is checked)
            held = block.dequantized() if block is not None else weight
            assert held is not None
            setattr(parent, leaf, _as_linear(held, old.bias))
    if placement.kernels is None:
        tower.to(device=placement.device, dtype=placement.dtype)
    return placement.describe(native, len(paths))
