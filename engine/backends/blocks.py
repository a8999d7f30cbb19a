"""Which block-quantized matrix each linear layer of a fused model runs, and the tied embedding that shares it.

A GGUF's tensors arrive as StoredTensor (engine.model.quant) keyed by Hugging Face parameter name and run as stored:
their bytes are copied, never dequantized and re-quantized; q/k/v and gate/up are fused by stacking rows of
blocks, which keeps every block intact. Parts stored in different formats (a Q4_K_M file's v as Q8_0 beside q, k
as Q5_0) are stacked as Q8_0 when every part widens to it without loss (engine.model.quant.widen_to_q8_0), and
otherwise kept as runs of one format each (its v as Q6_K beside q, k as Q4_K: BlockWeights.parts). An HF
folder's fp32 weights are quantized here at load to the chosen type, to the very bytes llama.cpp's converter
would write.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from engine.model.quant import (
    BLOCK,
    WIDENS_TO_Q8_0,
    BlockType,
    StoredTensor,
    check_stored,
    dequantize,
    quantize,
    widen_to_q8_0,
)

if TYPE_CHECKING:
    from engine.model.network import Transformer

# A fused module's rows, in order, from these HF parameters (engine.model.network.fuse_projections).
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
EMBEDDING = "model.embed_tokens.weight"


class UnsupportedBlocks(ValueError):
    """The stored weights use a format the block kernels do not run (e.g. Q2_K); the message says which."""


def _kernel_types() -> str:
    return ", ".join(t.name for t in BlockType)


@dataclass(frozen=True)
class BlockWeights:
    """One matrix (N, K) as raw blocks: blocks (N, K/32 * block bytes) uint8. A layer whose input size is no
    multiple of 32 (an HF folder's, never a GGUF's) is held with zero columns up to K: `in_features` is its own."""

    qtype: BlockType
    shape: tuple[int, int]
    blocks: torch.Tensor
    in_features: int = 0  # 0: shape[1]
    # A fused matrix whose parts are stored in different formats: its rows are these parts' in order (each of one
    # format, none with parts of its own), `blocks` is empty and `qtype` the first part's.
    parts: tuple[BlockWeights, ...] = ()

    @property
    def inputs(self) -> int:
        return self.in_features or self.shape[1]

    def dequantized(self) -> torch.Tensor:  # (N, inputs) float32
        if self.parts:
            return torch.cat([p.dequantized() for p in self.parts])
        return torch.from_numpy(dequantize(self.blocks.numpy(), self.qtype, self.shape))[:, : self.inputs]


def stored_type(stored: Mapping[str, StoredTensor]) -> BlockType:
    """The block format most of `stored` uses (what `auto` runs for the layers a file left unquantized)."""
    names = Counter(t.qtype for t in stored.values())
    if not names:
        raise UnsupportedBlocks("the file stores no quantized matrices")
    top = names.most_common(1)[0][0]
    try:
        return BlockType.named(top)
    except ValueError:
        raise UnsupportedBlocks(
            f"its weights are {top}, which has no block kernel here yet ({_kernel_types()} do)"
        ) from None


def _sources(path: str, tied: bool, stored: Mapping[str, StoredTensor]) -> list[str]:
    parent, _, leaf = path.rpartition(".")
    if leaf in FUSED:
        return [f"{parent}.{name}.weight" for name in FUSED[leaf]]
    if path == "lm_head" and tied and "lm_head.weight" not in stored:
        return [EMBEDDING]
    return [f"{path}.weight"]


def _from_stored(names: list[str], stored: Mapping[str, StoredTensor]) -> BlockWeights | None:
    parts = [stored[n] for n in names if n in stored]
    if len(parts) != len(names):
        return None
    kinds = sorted({p.qtype for p in parts})
    for kind, name in ((p.qtype, n) for p, n in zip(parts, names, strict=True)):
        if kind not in BlockType.__members__:
            raise UnsupportedBlocks(
                f"{name} is stored as {kind}, which has no block kernel here yet ({_kernel_types()} do)"
            )
    types = [check_stored(p, n) for p, n in zip(parts, names, strict=True)]
    data = [np.asarray(p.data, dtype=np.uint8).reshape(p.shape[0], -1) for p in parts]
    qtype = types[0]
    shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    if len(kinds) != 1 and not all(k in WIDENS_TO_Q8_0 for k in kinds):
        runs: list[BlockWeights] = []  # consecutive parts of one format stacked, in order
        for t, d in zip(types, data, strict=True):
            if runs and runs[-1].qtype is t:
                last = runs.pop()
                d = np.concatenate([last.blocks.numpy(), d])
            runs.append(BlockWeights(t, (d.shape[0], shape[1]), torch.from_numpy(np.array(d, dtype=np.uint8))))
        held = BlockWeights(runs[0].qtype, shape, torch.empty(0, dtype=torch.uint8), parts=tuple(runs))
    else:
        if len(kinds) != 1:
            qtype = BlockType.Q8_0
            data = [widen_to_q8_0(d, t) for d, t in zip(data, types, strict=True)]
            copy = np.concatenate(data)
        else:  # the parts' bytes copied once
            copy = np.empty((shape[0], data[0].shape[1]), dtype=np.uint8)  # (N, row bytes)
            at = 0
            for p in parts:
                _copy_releasing(p, copy[at : at + p.shape[0]])
                at += p.shape[0]
        held = BlockWeights(qtype, shape, torch.from_numpy(copy))
    for p in parts:  # held as copies now: loading never holds a model's weights twice
        p.release()
    return held


def plan_blocks(
    model: Transformer, qtype: BlockType, stored: Mapping[str, StoredTensor] | None = None
) -> dict[str, BlockWeights]:
    """Block weights for every nn.Linear of a fused `model`, keyed by module path: the stored bytes where `stored`
    has them, else the layer's fp32 weight quantized to `qtype` (zero columns pad an input size that is no multiple
    of 32; zeros quantize exactly), or to Q8_0 where a file's own format has no quantizer here (a K-quant).
    UnsupportedBlocks when stored bytes cannot run or `qtype` cannot be written."""
    if not qtype.quantizable and not stored:
        raise UnsupportedBlocks(
            f"there is no {qtype.name} quantizer here ({qtype.name} runs as a GGUF file stores it; "
            f"choose one of {', '.join(t.name.lower() for t in BlockType if t.quantizable)})"
        )
    fill = qtype if qtype.quantizable else BlockType.Q8_0
    tied = bool(model.config.tie_word_embeddings)
    out: dict[str, BlockWeights] = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        found = _from_stored(_sources(path, tied, stored), stored) if stored else None
        if found is None:
            w = module.weight.detach().float().numpy()  # (N, K)
            k = w.shape[1]
            padded = np.pad(w, ((0, 0), (0, -k % BLOCK)))  # (N, K rounded up to 32)
            found = BlockWeights(fill, (padded.shape[0], padded.shape[1]), torch.from_numpy(quantize(padded, fill)), k)
        if (found.shape[0], found.inputs) != tuple(module.weight.shape):
            raise ValueError(
                f"the stored {path} has shape {found.shape}, but the model's config says {tuple(module.weight.shape)}"
            )
        out[path] = found
    return out


class BlockEmbedding(nn.Module):
    """Embedding rows dequantized from a block matrix: the tied LM head's (one copy of the vocabulary), or the
    file's own token embedding."""

    blocks: torch.Tensor

    def __init__(self, w: BlockWeights) -> None:
        super().__init__()
        self.qtype, self.shape, self.dim = w.qtype, w.shape, w.inputs
        self.register_buffer("blocks", w.blocks, persistent=False)  # (V, C/32 * block bytes) uint8

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) long -> (B, T, C) float32
        rows = self.blocks.index_select(0, ids.reshape(-1)).numpy()  # (B*T, bytes)
        return torch.from_numpy(dequantize(rows, self.qtype, self.shape)[:, : self.dim]).reshape(*ids.shape, self.dim)


def swap_linears(
    model: Transformer,
    blocks: Mapping[str, BlockWeights],
    make: Callable[[BlockWeights, torch.Tensor | None], nn.Module],
) -> None:
    """Replace each planned nn.Linear by make(blocks, its bias); a tied embedding reads the LM head's blocks."""
    for path, w in blocks.items():
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, leaf)
        setattr(parent, leaf, make(w, old.bias))
    if model.config.tie_word_embeddings and "lm_head" in blocks:
        model.model.embed_tokens = BlockEmbedding(blocks["lm_head"])


def use_stored_embedding(model: Transformer, stored: Mapping[str, StoredTensor] | None) -> None:
    """An untied model whose file stores the embedding in a block format reads its rows from those bytes."""
    t = (stored or {}).get(EMBEDDING)
    if t is None or model.config.tie_word_embeddings or t.qtype not in BlockType.__members__:
        return
    qtype = check_stored(t, EMBEDDING)
    copy = np.empty((t.shape[0], t.row_bytes), dtype=np.uint8)  # (V, row bytes)
    _copy_releasing(t, copy)
    t.release()  # the pages that straddle two chunks
    model.model.embed_tokens = BlockEmbedding(BlockWeights(qtype, t.shape, torch.from_numpy(copy)))


def _copy_releasing(t: StoredTensor, out: np.ndarray) -> None:
    """out (N, row bytes) = t's rows, chunk by chunk, each chunk's file pages given back once copied: the file's
    pages and the copy are never both resident whole (a 262k-token embedding is 170 MB). The pages that straddle
    two chunks stay until the caller's `t.release()`."""
    rows = np.asarray(t.data, dtype=np.uint8).reshape(t.shape[0], -1)  # (N, row bytes)
    for a, b in t.row_chunks():
        out[a:b] = rows[a:b]
        t.release((a, b))


def dequantized_linear(w: BlockWeights, bias: torch.Tensor | None) -> nn.Linear:
    """The fallback without native kernels: the same blocks, dequantized to fp32 (activations stay fp32)."""
    lin = nn.Linear(w.inputs, w.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(w.dequantized(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
    return lin


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes the weights occupy: parameters and buffers, each storage once (a tied embedding shares its head's)."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
