"""PyTorch backends: cpu, cuda, mps — one implementation, three devices."""

from __future__ import annotations

import copy
import dataclasses
import os
import platform
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.backends.base import CANONICAL_KV_DTYPE, Backend, BackendProbe, PartTimer
from engine.backends.blocks import (
    BlockEmbedding,
    BlockWeights,
    UnsupportedBlocks,
    dequantized_linear,
    plan_blocks,
    resident_weight_bytes,
    stored_type,
    swap_linears,
    use_stored_embedding,
)
from engine.backends.native import VERIFY_PAYS_ISAS, NativeKernels, NativeStatus, activation_numerics, load_kernels
from engine.backends.native.decoder import (
    MAX_ROWS,
    NativeBlockEmbedding,
    NativeBlockLinear,
    NativeDecoder,
    plan_rows,
)
from engine.backends.vision_tower import TOWER_BLOCKS, TowerPlacement, place_tower
from engine.errors import BackendUnavailable
from engine.loading.model_files import release_file_pages
from engine.loading.weights import load_model
from engine.model.config import ModelConfig
from engine.model.kv_types import KVType
from engine.model.network import (
    ForwardCancelled,
    KVCache,
    SlotBatch,
    Transformer,
    fuse_projections,
    replace_linears,
)
from engine.model.quant import BlockType, StoredTensor
from engine.model.slots import DirectReads

# Compute dtype per device: CPU kernels are fastest (and exact vs references) in fp32; GPUs run fp16.
DEVICE_DTYPES: dict[str, torch.dtype] = {"cpu": torch.float32, "cuda": torch.float16, "mps": torch.float16}
# Weight storage choices: "none" keeps the checkpoint's weights in the compute dtype; the block formats are GGUF's
# (engine.model.quant); "auto" runs a GGUF's blocks as stored and quantizes an HF folder to AUTO_BLOCKS.
QUANTIZATIONS: tuple[str, ...] = ("auto", "none", *(t.name.lower() for t in BlockType))
# The most faithful fast type (bench quant on SmolLM2-135M: mean KLD from fp32 0.0011 at Q8_0, 0.044 at Q4_1).
AUTO_BLOCKS = BlockType.Q8_0
# What runs block weights on the CPU: our compiled kernels (engine.backends.native), PyTorch over the dequantized matrices,
# or the first when it can be built.
KERNEL_CHOICES: tuple[str, ...] = ("auto", "native", "torch")


def probe_torch_device(name: str) -> BackendProbe:
    if name == "cpu":
        return BackendProbe("cpu", True, f"{platform.machine()} CPU, {torch.get_num_threads()} threads")
    if name == "cuda":
        if torch.cuda.is_available():
            return BackendProbe("cuda", True, torch.cuda.get_device_name(0))
        built = torch.backends.cuda.is_built()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        why = "no NVIDIA GPU is visible" if built else "this PyTorch build has no CUDA support"
        return BackendProbe("cuda", False, f"CUDA is not available: {why}.")
    if name == "mps":
        if torch.backends.mps.is_available():
            return BackendProbe("mps", True, "Apple GPU via Metal Performance Shaders")
        why = (
            "this is not macOS on Apple Silicon"
            if platform.system() != "Darwin"
            else "Metal is not available on this Mac"
        )
        return BackendProbe("mps", False, f"MPS is not available: {why}.")
    raise ValueError(name)


class KMajorLinear(nn.Module):
    """y = x @ Wt (+ b) with the weight stored transposed, (in, out) row-major.

    Decoding multiplies one row by every weight matrix, so speed is memory bandwidth: on CPUs, MKL streams a
    (in, out) matrix ~1.35x faster than nn.Linear's (out, in) for a single row (measured 14.3 vs 10.6 GB/s on
    one thread; +19% decode tokens/s end to end on a SmolLM-135M shape). Same arithmetic, same tokens.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)  # (in, out)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        # Fold the leading dims into rows: `x @ W` on a 3-D x whose size-1 dims have odd strides (e.g. attention's
        # output at T=1) runs as bmm, one GEMV per batch row re-reading W each time (1.8x slower decode at B=32).
        y = (x.reshape(-1, x.shape[-1]) @ self.weight_t).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class ColumnEmbedding(nn.Module):
    """Embedding lookup from a (dim, vocab) matrix: the tied twin of a KMajorLinear LM head, sharing its storage."""

    def __init__(self, weight_t: nn.Parameter) -> None:
        super().__init__()
        self.weight_t = weight_t  # (C, V), shared with the LM head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        return self.weight_t.index_select(1, ids.reshape(-1)).t().reshape(*ids.shape, -1)


def use_k_major_linears(model: Transformer) -> None:
    """Swap every nn.Linear for a KMajorLinear (CPU decode layout). A tied LM head keeps one matrix: the embedding
    then reads columns of the transposed head instead of holding the vocabulary matrix twice."""
    replace_linears(model, KMajorLinear)
    if model.config.tie_word_embeddings:
        head = model.lm_head
        assert isinstance(head, KMajorLinear)  # swapped just above
        model.model.embed_tokens = ColumnEmbedding(head.weight_t)


def native_unfit(status: NativeStatus, config: ModelConfig, dtype: torch.dtype) -> str | None:
    """Why the native kernels cannot run this model (None when they can)."""
    if status.kernels is None:
        return status.reason
    if dtype != torch.float32:
        return f"they compute in float32, not {str(dtype).removeprefix('torch.')}"
    if config.head_dim > status.kernels.max_head_dim:
        return f"head dim {config.head_dim} exceeds their {status.kernels.max_head_dim}"
    return None


class TorchBackend(Backend):
    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype = CANONICAL_KV_DTYPE,
        quantize: str = "none",
        kernels: str = "auto",
        stored: Mapping[str, StoredTensor] | None = None,
        act_parts: int | None = None,
        native_steps: bool = True,
        kv_type: KVType = KVType.F16,
        native_chunks: bool = True,
    ) -> None:
        """`quantize` (CPU only): "none" keeps fp32; "q8_0", "q4_0", "q4_1" hold every linear layer in that GGUF block
        format (engine.model.quant), activations quantized per block of 32 as llama.cpp's dot products do; "auto" runs
        `stored` as stored, else Q8_0.

        `stored` maps Hugging Face parameter names to a GGUF's raw block tensors (the GGUF loader's output): those
        layers run from their bytes, never dequantized and re-quantized.

        `kv_dtype` defaults to the canonical fp16 on every device (math stays in `dtype`): what the slot table
        holds is then bit-identical to what episodic memory, the L3 cache and session files keep, so a restored or
        prefix-cached conversation continues exactly as an uninterrupted one. Pass float32 to compare the math with
        references at fp32 tolerance.

        `act_parts` (native kernels): activations quantized per block of 32 as int8 (1: llama.cpp's Q8 dot
        products) or int16 (2) with one scale per block; None (the default) by each matrix's format and the kernels'
        build: int8 for Q4_K and Q6_K on AVX-512 VNNI, int16 for the rest (engine.backends.native.activation_parts).
        bench quant measures the choices.

        `kernels` picks what runs block weights: "native" our compiled CPU kernels (engine.backends.native; an error when
        they cannot be built), "torch" PyTorch over the dequantized matrices, "auto" native when available.

        `kv_type` q8_0 holds keys and values as llama.cpp's q8_0 blocks (engine.model.kv_types), read as fp16;
        the native decoding step reads fp16 or fp32 tables only, so a q8_0 table's steps run through PyTorch.

        `native_steps`: with the native kernels, let a decoding step they cover run as one native call (the default);
        False runs every step through the PyTorch code over the same native layers (comparisons in tests).
        `native_chunks`: steps of 2 to MAX_ROWS tokens of one row (a speculative verify, a short chunk) in one native
        call too (the default); False runs them through PyTorch (tests of its read copies)."""
        if device == "mps":
            # Ops MPS lacks fall back to CPU instead of failing mid-conversation.
            os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")
        if quantize == "int8":
            raise BackendUnavailable(
                "int8 weights are a Core ML conversion; on the CPU choose q8_0, q4_0, q4_1 or auto."
            )
        if quantize not in QUANTIZATIONS:
            raise BackendUnavailable(
                f"Unknown weight quantization {quantize!r}; choose one of {', '.join(QUANTIZATIONS)}."
            )
        if quantize not in ("none", "auto") and device != "cpu":
            raise BackendUnavailable(f"{quantize} weights run on the cpu backend only, not on {device}.")
        if kernels not in KERNEL_CHOICES:
            raise BackendUnavailable(f"Unknown CPU kernels {kernels!r}; choose one of {', '.join(KERNEL_CHOICES)}.")
        self.name = device
        self.device = torch.device(device)
        self.dtype = dtype or DEVICE_DTYPES[device]
        # A GGUF's block matrices are left undecoded when they may run as stored (no transient fp32 copy).
        leave_stored = self.device.type == "cpu" and quantize != "none" and stored is None
        loaded = load_model(model_dir, device=self.device, dtype=self.dtype, leave_stored=leave_stored)
        self.model = loaded.model
        self.config = loaded.config
        self.fingerprint = loaded.fingerprint
        fuse_projections(self.model)
        self.native_isa: str | None = None  # the native kernels' instruction set when they run this model
        self.native_steps = native_steps
        self.native_chunks = native_chunks  # steps of 2 to MAX_ROWS tokens of one row natively too (a verify)
        self.decoder: NativeDecoder | None = None  # runs the decoding steps it accepts (see forward)
        self._native_span: Callable[[], AbstractContextManager[object]] | None = None  # see timed_parts
        self._one_token = False  # whether the last forward fed one row one token (token_summaries)
        self.kernels_note = ""  # which kernels run the block weights, and why those (the backend explanation)
        self.act_parts = act_parts
        self.act_formats: set[int] = set()  # the activation formats the native layers take (numerics)
        stored = loaded.stored if stored is None else stored  # a GGUF's blocks, as the loader found them
        self.quantize = self._block_weights(quantize, kernels, stored) if device == "cpu" else "none"
        if any(p.is_meta for p in self.model.parameters()):  # the stored blocks cannot all run: read them in fp32
            self.model = load_model(model_dir, device=self.device, dtype=self.dtype).model
            fuse_projections(self.model)
        if self.quantize == "none" and self.device.type == "cpu":
            use_k_major_linears(self.model)
        self.weight_bytes = resident_weight_bytes(self.model)  # as finally held: fused, transposed or in blocks
        release_file_pages(model_dir)  # the blocks and fused matrices are copies: the file's pages would count twice
        self.kv_dtype = kv_dtype
        self.cache: KVCache = self.model.new_cache(1, 32, kv_dtype)
        self.set_kv_type(kv_type)

    def _block_weights(self, quantize: str, kernels: str, stored: Mapping[str, StoredTensor] | None) -> str:
        """Swap the linear layers for block-quantized ones; returns the format now held ("none": fp32 kept)."""
        if quantize == "none":
            return "none"
        try:
            qtype = (
                (stored_type(stored) if stored else AUTO_BLOCKS) if quantize == "auto" else BlockType.named(quantize)
            )
            if stored and quantize != "auto" and stored_type(stored) is not qtype:
                raise BackendUnavailable(
                    f"This file stores {stored_type(stored).name} weights, which run as stored: choose --quantize auto (or none for fp32)."
                )
            blocks = plan_blocks(self.model, qtype, stored)
        except UnsupportedBlocks as exc:
            if quantize != "auto":
                raise BackendUnavailable(f"These weights cannot run as {quantize}: {exc}.") from None
            self.kernels_note = f"fp32 ({exc})"
            return "none"
        except ValueError as exc:
            if quantize != "auto":
                raise BackendUnavailable(f"This model cannot be held as {quantize}: {exc}.") from None
            self.kernels_note = f"fp32 ({exc})"
            return "none"
        native = load_kernels() if kernels != "torch" else None
        why_not = None if native is None else native_unfit(native, self.config, self.dtype)
        if native is not None and native.kernels is not None and why_not is None:
            self._use_native_blocks(native.kernels, blocks)
            self.native_isa = native.kernels.isa
            self.kernels_note = f"native {self.native_isa} kernels"
        elif kernels == "native":
            raise BackendUnavailable(f"The native CPU kernels are unavailable: {why_not}.")
        else:
            # Same blocks dequantized to fp32 (activations stay fp32): slower, as faithful.
            swap_linears(self.model, blocks, dequantized_linear)
            use_k_major_linears(self.model)
            self.kernels_note = "PyTorch fp32 over the dequantized blocks" + (f" ({why_not})" if why_not else "")
        use_stored_embedding(self.model, stored)
        return qtype.name.lower()

    def _use_native_blocks(self, kernels: NativeKernels, blocks: Mapping[str, BlockWeights]) -> None:
        """Every linear layer on the native kernels (the model's head_dim fits kernels.max_head_dim: native_unfit),
        and a one-call decoding step over them when `native_steps`."""
        act_parts = self.act_parts
        swap_linears(self.model, blocks, lambda w, bias: NativeBlockLinear(kernels, w, bias, act_parts))
        self.act_formats = {m.desc.act_parts for m in self.model.modules() if isinstance(m, NativeBlockLinear)}
        head: nn.Module = self.model.lm_head  # swapped for a NativeBlockLinear when planned
        if isinstance(self.model.model.embed_tokens, BlockEmbedding) and isinstance(head, NativeBlockLinear):
            self.model.model.embed_tokens = NativeBlockEmbedding(kernels, head)  # the tied head's rows, natively
        if self.native_steps and self.config.plain_llama:  # its one-call step implements the Llama layer only
            self.decoder = NativeDecoder(kernels, self.model)

    def place_tower(self, tower: nn.Module, stored: Mapping[str, StoredTensor] | None = None) -> str:
        """A vision tower onto this backend (engine.backends.vision_tower): on the native kernels' block products
        where the text model runs on them (fp32 weights held as TOWER_BLOCKS, `stored` ones as stored), else this
        backend's device and dtype. Returns the line that says which."""
        native = load_kernels().kernels if self.native_isa is not None else None
        blocks = TOWER_BLOCKS if native is not None else None
        return place_tower(tower, TowerPlacement(self.device, self.dtype, native, blocks), stored)

    @contextmanager
    def timed_parts(self, timer: PartTimer) -> Iterator[None]:
        """Module-boundary hooks on the network report each part to `timer`; a native decoding step (every layer and
        the head in one call) runs inside `timer.native_step()`."""

        def opener(name: str) -> Callable[[nn.Module, Any], None]:
            return lambda module, args: timer.open_part(name)

        def closer(module: nn.Module, args: Any, out: Any) -> None:
            timer.close_part()

        backbone = self.model.model
        handles = [
            backbone.embed_tokens.register_forward_pre_hook(opener("embedding")),
            backbone.embed_tokens.register_forward_hook(closer),
        ]
        for i, layer in enumerate(self.model.decoder_layers()):
            handles.append(layer.input_layernorm.register_forward_pre_hook(opener(f"layer.{i}.attention")))
            handles.append(layer.post_attention_layernorm.register_forward_pre_hook(opener(f"layer.{i}.mlp")))
        handles.append(backbone.norm.register_forward_pre_hook(opener("lm_head")))  # final norm + head
        handles.append(self.model.lm_head.register_forward_hook(closer))
        before, self._native_span = self._native_span, timer.native_step
        try:
            yield
        finally:
            self._native_span = before
            for h in handles:
                h.remove()

    @property
    def verify_pays(self) -> bool:
        """Where a verify runs as one native call on kernels measured to make it pay (VERIFY_PAYS_ISAS). Through
        PyTorch on the CPU a verify's products cost nearly a decode step per token; MPS and CUDA are not measured."""
        return self.decoder is not None and self.native_chunks and self.native_isa in VERIFY_PAYS_ISAS

    @property
    def numerics(self) -> str:
        weights = (
            ""
            if self.quantize == "none"
            else f"-w{self.quantize}" + (f"native-{activation_numerics(self.act_formats)}" if self.native_isa else "")
        )
        # "-r2": keys are read through fp16 copies or rotated inside the native attention (not fp32 copies), which
        # changes the bits of every later token's KV, so prefix-cache entries of the earlier reads are not reused.
        # "-r3": the native decoding attention scores and sums on vectors with fused multiply-adds (other bits).
        kv = str(self.kv_dtype).removeprefix("torch.") if self.kv_type is KVType.F16 else self.kv_type.value
        reads = "-r3" if self.decoder is not None else "-r2"
        return f"torch-{self.device.type}-{str(self.dtype).removeprefix('torch.')}{weights}-kv{kv}{reads}"

    @property
    def batch(self) -> int:
        return self.cache.batch

    def set_kv_type(self, kv_type: KVType) -> None:
        why_not = kv_type.fits(self.config.head_dim)
        if why_not is not None:
            raise BackendUnavailable(f"This model cannot hold its KV as {kv_type.value}: {why_not}.")
        self.kv_type = kv_type
        self.cache = self.model.new_cache(self.batch, self.num_slots, self.kv_dtype, kv_type)

    def slot_bytes_per_token(self) -> int:
        """k, v in the KV dtype, plus read copies where steps run through PyTorch (engine.model.slots)."""
        reads = self.decoder is None or self.cache.reads_in_use
        return KVCache.bytes_per_slot(self.config, self.kv_dtype, reads, self.cache.compute_dtype, self.kv_type)

    def kv_resident_bytes(self) -> int:
        return self.cache.allocated_bytes()

    def release(self) -> None:
        self.cache.release()

    def expect(self, slots: int) -> None:
        self.cache.reserve_ahead(slots)

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    runs_leading_rows = True

    def allocate(self, batch: int, num_slots: int) -> None:
        self.cache = self.model.new_cache(batch, num_slots, self.kv_dtype, self.kv_type)
        self._rows_run = self.cache.batch

    def widen(self, num_slots: int) -> None:
        self.cache.widen(num_slots)

    def fork(self) -> TorchBackend:
        twin = copy.copy(self)  # shares self.model (weights) by reference
        twin.cache = self.model.new_cache(self.batch, self.num_slots, self.kv_dtype, self.kv_type)
        return twin

    def position_offsets(self, tokens: Sequence[int], new: int) -> torch.Tensor | None:
        hook = self.model.position_offsets
        return None if hook is None else hook(tokens, len(tokens) - new)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        batch: SlotBatch,
        last_only: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        dev = self.device
        self.model.rotary().cover(batch.position_bound())  # on the host, before the batch moves to the device
        if dev.type != "cpu":
            tokens = tokens.to(dev, non_blocking=True)
            fields = {
                f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
            }  # astuple would deep-copy the tensors
            moved: dict[str, Any] = {k: None if t is None else t.to(dev, non_blocking=True) for k, t in fields.items()}
            batch = dataclasses.replace(batch, **moved)
        rows = tokens.shape[0]
        if rows != getattr(self, "_rows_run", self.cache.batch):
            # Rows outside the previous forward's view hold stale read copies: re-derive every row's this time.
            self.cache.forget()
            self._rows_run = rows
        native = (
            self.decoder is not None
            and batch.offsets is None  # the one-call step rotates by the slot's position alone
            and rows == 1
            and tokens.shape[1] <= (MAX_ROWS if self.native_chunks else 1)
            and self.decoder.accepts(self.cache)
        )
        self.cache.token_summaries.clear()
        self._one_token = tokens.shape == (1, 1)
        # Grow the whole table (and its read copies where PyTorch will read them) before any view of it is taken.
        self.cache.reserve_for(batch, read_copies=not native and self.cache.reads_pay(tokens.shape[1]))
        cache = self.cache if rows == self.cache.batch else self.cache.leading_rows(rows)
        if native:
            out = self._native_step(tokens, cache, batch)  # (1, T, V)
            return out[:, -1:] if last_only else out
        try:
            logits: torch.Tensor = self.model(tokens, cache, batch, last_only=last_only, should_stop=should_stop)
        except ForwardCancelled:
            # The step's plan marked its read copies fresh for every layer; only the layers before the stop made them.
            self.cache.forget()
            raise
        return logits.float().cpu() if dev.type != "cpu" or logits.dtype != torch.float32 else logits

    def _native_step(self, tokens: torch.Tensor, cache: KVCache, batch: SlotBatch) -> torch.Tensor:
        """tokens (1, T), T <= MAX_ROWS -> logits (1, T, V): the whole step in one native call."""
        decoder = self.decoder
        assert decoder is not None
        rope = self.model.rotary()
        x = self.model.model.embed_tokens(tokens)  # (1, T, C)
        reads = cache.plan_direct(batch, rope) if tokens.shape[1] == 1 else plan_rows(cache, batch, rope)
        with nullcontext() if self._native_span is None else self._native_span():
            if isinstance(reads, DirectReads):
                return decoder.decode(x, cache, batch, reads, rope)
            return decoder.decode_rows(x, cache, batch, reads, rope)

    def query_summary(self) -> torch.Tensor:
        return self.cache.summary.transpose(0, 1).to("cpu", torch.float32).clone()  # (B, L, Hkv, D)

    def token_summaries(self) -> torch.Tensor | None:
        per_layer = self.cache.token_summaries  # L x (T, Hkv, D); empty after a one-token native step or a large one
        if per_layer:
            return torch.stack(per_layer, dim=1).to("cpu", torch.float32)  # (T, L, Hkv, D)
        if self._one_token:  # the native step: one token, whose summary is the step's
            return self.cache.summary[:, :1].transpose(0, 1).to("cpu", torch.float32).clone()  # (1, L, Hkv, D)
        return None

    @torch.inference_mode()
    def read_kv(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if slots.numel() and int(slots.max()) >= self.cache.num_slots:
            raise IndexError(f"slot {int(slots.max())} is outside a table of {self.cache.num_slots} slots")
        k, v = self.cache.read_rows(row, slots.to(self.device))  # (L, Hkv, n, D) each; unallocated slots read as 0
        return k.to("cpu", CANONICAL_KV_DTYPE), v.to("cpu", CANONICAL_KV_DTYPE)

    @torch.inference_mode()
    def write_kv(self, row: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if slots.numel():
            self.cache.reserve(int(slots.max()) + 1)
        s = slots.to(self.device)
        self.cache.write_rows(row, s, k.to(self.device), v.to(self.device))
        self.cache.forget(s)
