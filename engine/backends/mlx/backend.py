"""MLXBackend: the Backend protocol (engine.backends.base) on MLX — the network (engine.backends.mlx.network), its
slot table (engine.backends.mlx.slots) and its weights (engine.backends.mlx.weights).

It computes in fp32 on the CPU (`mlx-cpu`: a correctness path, compared with TorchBackend in CI) and in fp16 on the
Apple GPU; the table holds the canonical fp16 KV either way. Weights load through our own loaders (a GGUF's names,
q/k row order and checks; an HF folder's family layouts), then become MLX arrays: one copy of the weights at a time
beside the file's pages.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch

from engine.backends.base import CANONICAL_KV_DTYPE, Backend
from engine.backends.mlx.folders import folder_quantization, load_mlx_folder
from engine.backends.mlx.network import MLXNetwork
from engine.backends.mlx.slots import MLXSlotTable, MLXStep, RopeTables
from engine.backends.mlx.weights import MLX_BITS, Weight, convert, weight_bytes
from engine.errors import BackendUnavailable
from engine.loading.model_files import release_file_pages
from engine.loading.weights import load_model
from engine.model.attention import ROTARY_HEADROOM
from engine.model.kv_types import KVType
from engine.model.quant import BlockType
from engine.model.slots import SlotBatch

# Compute dtype where MLX runs: fp32 on the CPU (exact against the torch backend's fp32), fp16 on Metal (as MPS).
DEVICE_DTYPES: dict[str, mx.Dtype] = {"cpu": mx.float32, "gpu": mx.float16}
# --quantize choices here: "none" dense weights; "auto" a GGUF's blocks as stored where MLX runs them (MLX_BITS), an
# HF folder's as AUTO_BLOCKS; q8_0, q5_0, q4_0, q4_1: an HF folder quantized by our GGUF quantizers, then repacked.
QUANTIZATIONS: tuple[str, ...] = ("auto", "none", *(t.name.lower() for t in MLX_BITS if t.quantizable))
AUTO_BLOCKS = BlockType.Q8_0  # as the CPU backend's auto (bench quant: mean KLD 0.0011 from fp32 on SmolLM2-135M)


class MLXBackend(Backend):
    name = "mlx"
    runs_leading_rows = True

    def __init__(
        self, model_dir: str | Path, quantize: str = "auto", device: str | None = None, dtype: mx.Dtype | None = None
    ) -> None:
        """`device` "cpu" or "gpu" (default: the GPU where Metal is available); `dtype` the compute dtype (default:
        the device's, DEVICE_DTYPES; tests run the GPU's fp16 on the CPU)."""
        if quantize not in QUANTIZATIONS:
            raise BackendUnavailable(f"The mlx backend runs {', '.join(QUANTIZATIONS)} weights, not {quantize!r}.")
        self.device = device or ("gpu" if mx.metal.is_available() else "cpu")
        if self.device == "gpu" and not mx.metal.is_available():
            raise BackendUnavailable("MLX has no Metal device here; run the mlx backend on its cpu device.")
        mx.set_default_device(mx.gpu if self.device == "gpu" else mx.cpu)
        self.dtype = dtype or DEVICE_DTYPES[self.device]
        folder = Path(model_dir).expanduser()
        quant = folder_quantization(folder)
        if quant is not None:  # an MLX-quantized folder: its weights run as it stores them
            if quantize not in ("auto", "none"):
                raise BackendUnavailable(
                    f"This MLX folder stores {quant.bits}-bit weights, which run as stored: choose --quantize auto."
                )
            self.config, self.fingerprint, weights, self.kernels_note = load_mlx_folder(folder, quant, self.dtype)
            self.quantize = f"mlx{quant.bits}g{quant.group_size}"
        else:
            weights = self._load(folder, quantize)
        self.weight_bytes = weight_bytes(weights)
        self.net = MLXNetwork(self.config, weights, self.dtype)
        self.rope = RopeTables(self.config, self.config.max_position_embeddings + ROTARY_HEADROOM, self.dtype)
        self.kv_type = KVType.F16
        self.table = MLXSlotTable(self.config, 1, 32)
        self._summary = np.zeros(self._summary_shape(1), np.float32)  # (B, L, Hkv, D)
        self._token_summaries: np.ndarray | None = None

    def _load(self, model_dir: Path, quantize: str) -> dict[str, Weight]:
        """A GGUF or HF folder through our loader, its matrices as `quantize` asks (see QUANTIZATIONS)."""
        # Read in fp32 for fp32 compute, else in fp16 (an fp16 HF folder then stays a view of its file until each
        # matrix is copied into MLX, never a whole fp32 copy of a large model).
        read_as = torch.float32 if self.dtype == mx.float32 else torch.float16
        loaded = load_model(model_dir, "cpu", read_as, leave_stored=quantize != "none")
        self.config, self.fingerprint = loaded.config, loaded.fingerprint
        stored = loaded.stored
        blocks: BlockType | None = None
        if quantize == "auto":
            blocks = AUTO_BLOCKS
        elif quantize != "none":
            blocks = BlockType.named(quantize)
            held = Counter(t.qtype for t in stored.values()).most_common(1)[0][0] if stored else blocks.name
            if held != blocks.name:
                raise BackendUnavailable(
                    f"This file stores {held} weights, which run as stored: choose --quantize auto (or none)."
                )
        params = dict(loaded.model.state_dict())
        if self.config.tie_word_embeddings:
            params.pop("lm_head.weight", None)
        weights, self.quantize, self.kernels_note = convert(
            params, stored, self.config.num_hidden_layers, self.dtype, blocks
        )
        if self.config.tie_word_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        del loaded, params
        release_file_pages(model_dir)
        mx.eval([w for w in weights.values() if isinstance(w, mx.array)])
        return weights

    def _summary_shape(self, batch: int) -> tuple[int, int, int, int]:
        c = self.config
        return (batch, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)

    @property
    def numerics(self) -> str:
        weights = "" if self.quantize == "none" else f"-w{self.quantize}"
        kv = "float16" if self.kv_type is KVType.F16 else self.kv_type.value
        return f"mlx-{self.device}-{str(self.dtype).removeprefix('mlx.core.')}{weights}-kv{kv}"

    def set_kv_type(self, kv_type: KVType) -> None:
        why_not = kv_type.fits(self.config.head_dim)
        if why_not is not None:
            raise BackendUnavailable(f"This model cannot hold its KV as {kv_type.value}: {why_not}.")
        self.kv_type = kv_type
        self.table = MLXSlotTable(self.config, self.batch, self.num_slots, kv_type)

    def slot_bytes_per_token(self) -> int:
        """k and v as the table holds them (fp16, or q8_0's 34 bytes per 32 values), no read copies."""
        c = self.config
        return int(2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.kv_type.bytes_per_value())

    @property
    def batch(self) -> int:
        return self.table.batch

    @property
    def num_slots(self) -> int:
        return self.table.max_slots

    def allocate(self, batch: int, num_slots: int) -> None:
        self.table = MLXSlotTable(self.config, batch, num_slots, self.kv_type)
        self._summary = np.zeros(self._summary_shape(batch), np.float32)

    def widen(self, num_slots: int) -> None:
        self.table.max_slots = max(self.table.max_slots, num_slots)

    def fork(self) -> MLXBackend:
        twin = copy.copy(self)  # shares the network (weights) and the rotary tables
        twin.table = MLXSlotTable(self.config, self.batch, self.num_slots, self.kv_type)
        twin._summary = np.zeros_like(self._summary)
        twin._token_summaries = None
        return twin

    def kv_resident_bytes(self) -> int:
        return self.table.nbytes()

    def release(self) -> None:
        self.table.release()

    def expect(self, slots: int) -> None:
        self.table.reserve(min(self.table.max_slots, slots), exact=True)

    def forward(
        self,
        tokens: torch.Tensor,
        batch: SlotBatch,
        last_only: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        rows = int(tokens.shape[0])
        if rows > self.table.batch:
            raise ValueError(f"{rows} rows of tokens for a table of {self.table.batch}")
        self.rope.cover(batch.position_bound())
        written = int(batch.write_slots.max()) + 1 if batch.write_slots.numel() else 0
        self.table.reserve(max(int(batch.slot_positions.shape[1]), written))
        step = MLXStep(self.table, batch, self.rope, self.dtype)
        ids = mx.array(tokens.to(torch.int32).numpy())

        def settle(x: mx.array) -> None:
            mx.eval(x, self.table.buffers())

        self._token_summaries = None
        logits = self.net.forward(ids, step, last_only, should_stop, settle).astype(mx.float32)
        summary = mx.stack(step.summaries, axis=1)  # (B', L, Hkv, D)
        mx.eval(logits, summary, self.table.buffers(), step.token_summaries)
        self._summary[:rows] = np.array(summary)
        if step.token_summaries:
            self._token_summaries = np.array(mx.stack(step.token_summaries, axis=1))  # (T, L, Hkv, D)
        return torch.from_numpy(np.array(logits))

    def query_summary(self) -> torch.Tensor:
        return torch.from_numpy(self._summary.copy())

    def token_summaries(self) -> torch.Tensor | None:
        return None if self._token_summaries is None else torch.from_numpy(self._token_summaries.copy())

    def read_kv(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if slots.numel() and int(slots.max()) >= self.table.max_slots:
            raise IndexError(f"slot {int(slots.max())} is outside a table of {self.table.max_slots} slots")
        k, v = self.table.read_rows(row, slots.to(torch.int64).numpy())
        return torch.from_numpy(k).to(CANONICAL_KV_DTYPE), torch.from_numpy(v).to(CANONICAL_KV_DTYPE)

    def write_kv(self, row: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if not slots.numel():
            return
        self.table.reserve(int(slots.max()) + 1)
        self.table.write_rows(
            row, slots.to(torch.int64).numpy(), k.to(torch.float16).numpy(), v.to(torch.float16).numpy()
        )
