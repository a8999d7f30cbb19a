"""The model's block-quantized CPU path on the native kernels: linear layers, and a whole decoding step in one call.

The CPU backend (engine.backends.torch_backend) replaces every linear layer with a NativeBlockLinear (GGUF blocks,
engine.model.quant; any number of rows: prefill chunks and batches call it like nn.Linear) and decides per step whether
a NativeDecoder runs it: every decoding step of one row (one new token, or a few: MAX_ROWS, a speculative verify),
whatever the memory changed before it; its attention (spark_attention.c) reads the table as stored, rotating keys as
it reads them, each token over its own addressing. Every other step runs the
PyTorch code over the same NativeBlockLinear layers, whose rows the kernel computes exactly as the decoding step does,
so both paths share weights, arithmetic and the slot table.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.backends.blocks import BlockEmbedding, BlockWeights
from engine.backends.native import CacheDesc, ModelDesc, NativeKernels, QMat, StepDesc, activation_parts
from engine.model.attention import RotaryTable
from engine.model.network import DecoderLayer, Transformer
from engine.model.slots import DirectReads, KVCache, SlotBatch

MAX_ROWS = 16  # the most tokens one native step takes (spark_kernels.h's SPARK_MAX_STEP_ROWS)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeBlockLinear(nn.Module):
    """y = x @ W^T + b with W in a GGUF block format and x quantized per block of 32 at call time, in one int8
    part (llama.cpp's Q8 activations) or 2 (int16 blocks with one scale); `act_parts` None: by W's formats
    (engine.backends.native.activation_parts)."""

    blocks: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, kernels: NativeKernels, w: BlockWeights, bias: torch.Tensor | None, act_parts: int | None = None
    ) -> None:
        super().__init__()
        if act_parts is None:
            act_parts = activation_parts([p.qtype.ggml_id for p in w.parts] or [w.qtype.ggml_id], kernels.isa)
        self.kernels = kernels
        self.qtype = w.qtype
        self.out_features, self.in_features = w.shape[0], w.inputs
        self.padded = w.shape[1]  # K rounded up to 32: zero weight columns beyond in_features
        self.register_buffer("blocks", w.blocks, persistent=False)  # (N, padded/32 * block bytes) uint8
        self.register_buffer(
            "bias", None if bias is None else bias.detach().float().contiguous(), persistent=False
        )  # (N,)
        self.desc = QMat(_ptr(self.blocks), _ptr(self.bias), self.out_features, self.padded, w.qtype.ggml_id, act_parts)
        # A fused matrix of parts in different formats: one layer per part, their descriptors chained from the first.
        starts = list(itertools.accumulate((p.shape[0] for p in w.parts), initial=0))
        biases = [None if bias is None else bias[a:b] for a, b in itertools.pairwise(starts)]
        self.parts = nn.ModuleList(
            NativeBlockLinear(kernels, p, b, act_parts) for p, b in zip(w.parts, biases, strict=True)
        )
        descs = [p.desc for p in self.parts if isinstance(p, NativeBlockLinear)]
        for first, then in itertools.pairwise(descs):
            first.next = ctypes.pointer(then)
        self.desc = descs[0] if descs else self.desc

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) float32 -> (..., N) float32
        if len(self.parts):
            return torch.cat([p(x) for p in self.parts], dim=-1)
        rows = x.reshape(-1, self.in_features).float().contiguous()  # (M, K)
        if self.padded != self.in_features:
            rows = torch.nn.functional.pad(rows, (0, self.padded - self.in_features))  # (M, padded) zero columns
        m = rows.shape[0]
        y = torch.empty(m, self.out_features)  # (M, N)
        scratch = torch.empty(int(self.kernels.lib.spark_act_bytes(self.padded, m)), dtype=torch.uint8)
        if m > 1:
            self.kernels.use_threads(torch.get_num_threads())
        self.kernels.lib.spark_qgemm(ctypes.byref(self.desc), rows.data_ptr(), m, y.data_ptr(), scratch.data_ptr())
        return y.view(*x.shape[:-1], self.out_features)


class NativeBlockEmbedding(BlockEmbedding):
    """The tied embedding over its LM head's blocks, rows dequantized by the kernels (the same float operations as
    engine.model.quant.dequantize; a type they do not cover takes BlockEmbedding's path)."""

    def __init__(self, kernels: NativeKernels, head: NativeBlockLinear) -> None:
        super().__init__(BlockWeights(head.qtype, (head.out_features, head.padded), head.blocks, head.in_features))
        self.kernels = kernels
        self.desc = head.desc  # points into head.blocks, which self.blocks shares

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) long -> (B, T, C) float32
        flat = ids.reshape(-1).to(torch.int64).contiguous()  # (B*T,)
        out = torch.empty(flat.numel(), self.shape[1])  # (B*T, K)
        done = self.kernels.lib.spark_dequant_rows(
            ctypes.byref(self.desc), flat.data_ptr(), flat.numel(), out.data_ptr()
        )
        if done == 0:
            return super().forward(ids)
        if done < 0:
            raise IndexError(f"a token id is outside the vocabulary of {self.shape[0]}")
        return out[:, : self.dim].reshape(*ids.shape, self.dim)


def _qmat(m: nn.Module | None) -> QMat:
    """The native descriptor of a layer the backend swapped for a NativeBlockLinear."""
    assert isinstance(m, NativeBlockLinear), m
    return m.desc


@dataclass(frozen=True)
class _Work:
    """A decoding step's working memory, reused step after step (the kernel overwrites all of it)."""

    residual: torch.Tensor  # (C,) the residual stream
    scratch: torch.Tensor  # (spark_decode_scratch_floats,) activations between the step's matrices
    partial: torch.Tensor  # (>= spark_attend_floats,) the attention's per-chunk running softmax


class NativeDecoder:
    """One decoding step of a fused, NativeBlockLinear model in a single native call: one token (spark_decode) or a
    few (spark_decode_rows: each matrix's weights read once for all of them, as a verify wants)."""

    def __init__(self, kernels: NativeKernels, model: Transformer) -> None:
        cfg = model.config
        layers = model.decoder_layers()
        n = len(layers)
        self.kernels = kernels
        self.model = model  # holds every buffer the descriptors point into

        def mats(get: Callable[[DecoderLayer], nn.Module | None]) -> ctypes.Array[QMat]:
            return (QMat * n)(*[_qmat(get(layer)) for layer in layers])

        self._arrays = (
            (ctypes.c_void_p * n)(*[layer.input_layernorm.weight.data_ptr() for layer in layers]),
            (ctypes.c_void_p * n)(*[layer.post_attention_layernorm.weight.data_ptr() for layer in layers]),
            mats(lambda layer: layer.self_attn.qkv_proj),
            mats(lambda layer: layer.self_attn.o_proj),
            mats(lambda layer: layer.mlp.gate_up_proj),
            mats(lambda layer: layer.mlp.down_proj),
        )
        attn_norm, mlp_norm, qkv, o, gate_up, down = self._arrays
        self.desc = ModelDesc(
            n,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
            ctypes.cast(attn_norm, ctypes.POINTER(ctypes.c_void_p)),
            ctypes.cast(mlp_norm, ctypes.POINTER(ctypes.c_void_p)),
            qkv,
            o,
            gate_up,
            down,
            model.model.norm.weight.data_ptr(),
            ctypes.pointer(_qmat(model.lm_head)),
        )
        self.vocab = model.lm_head.out_features
        self.scratch_floats = int(kernels.lib.spark_decode_scratch_floats(ctypes.byref(self.desc)))
        self._local = threading.local()  # each thread's _Work

    def accepts(self, cache: KVCache) -> bool:
        """The native step covers a table of one row in fp16 or fp32 (a step of one token: the caller checks)."""
        return (
            cache.batch == 1
            and cache.k.is_contiguous()  # not a view of one row of a bigger table (KVCache.leading_rows)
            and cache.k.dtype in (torch.float16, torch.float32)
        )

    def decode(
        self, x: torch.Tensor, cache: KVCache, batch: SlotBatch, reads: DirectReads, rope: RotaryTable
    ) -> torch.Tensor:
        """x (1, 1, C) embedded token -> logits (1, 1, V); writes the token's k, v into `cache`. `rope` is the table
        `reads` was planned with (its positions index it)."""
        held: list[torch.Tensor] = []  # the tensors the step's pointers point into, alive until the call returns
        # the step's query summary, as the PyTorch path writes it: (L, 1, Hkv, D)
        step = self._step(reads, int(batch.write_slots[0, 0]), rope, cache.summary.data_ptr(), held)
        logits = torch.empty(self.vocab)  # (V,) a new tensor each step: callers may keep it
        work = self._work(int(self.kernels.lib.spark_attend_floats(self.desc.n_heads, self.desc.head_dim, step.width)))
        work.residual.copy_(x.reshape(-1))  # (C,) updated in place by the kernel
        self.kernels.use_threads(torch.get_num_threads())  # the hardware policy's count (engine.hw), or --threads
        self.kernels.lib.spark_decode(
            ctypes.byref(self.desc),
            ctypes.byref(self._table(cache)),
            ctypes.byref(step),
            work.residual.data_ptr(),
            logits.data_ptr(),
            work.scratch.data_ptr(),
            work.partial.data_ptr(),
        )
        return logits.view(1, 1, -1)

    def decode_rows(
        self, x: torch.Tensor, cache: KVCache, batch: SlotBatch, reads: list[DirectReads], rope: RotaryTable
    ) -> torch.Tensor:
        """x (1, T, C) embedded tokens, 1 <= T <= MAX_ROWS, with each token's reads (plan_rows) -> logits (1, T, V);
        writes their k, v into `cache`, its query summary and each token's (cache.token_summaries). Row t equals what the t-th of T
        one-token `decode` calls gives: the same products (the kernels' rows agree bit for bit) and attention."""
        t = len(reads)
        assert x.shape[1] == t and 1 <= t <= MAX_ROWS, (x.shape, t)
        cfg = self.model.config
        summaries = torch.empty(t, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)  # (T, L, Hkv, D)
        held: list[torch.Tensor] = []
        steps = (StepDesc * t)(
            *[
                self._step(r, int(batch.write_slots[0, i]), rope, summaries[i].data_ptr(), held)
                for i, r in enumerate(reads)
            ]
        )
        widest = max(s.width for s in steps)
        partial = torch.empty(int(self.kernels.lib.spark_attend_floats(self.desc.n_heads, self.desc.head_dim, widest)))
        scratch = torch.empty(int(self.kernels.lib.spark_decode_rows_scratch_floats(ctypes.byref(self.desc), t)))
        residual = x.reshape(t, -1).float().clone()  # (T, C) updated in place by the kernel
        logits = torch.empty(t, self.vocab)  # (T, V)
        self.kernels.use_threads(torch.get_num_threads())
        done = self.kernels.lib.spark_decode_rows(
            ctypes.byref(self.desc),
            ctypes.byref(self._table(cache)),
            steps,
            t,
            residual.data_ptr(),
            logits.data_ptr(),
            scratch.data_ptr(),
            partial.data_ptr(),
        )
        assert done == 1, t  # t is within [1, MAX_ROWS], checked above
        # The step's query summary and each token's, as the PyTorch path records them (SlotStep.record_queries).
        weights = torch.full((t,), 1.0 / t) if batch.summary_weights is None else batch.summary_weights[0].float()
        cache.summary[:, 0] = torch.einsum("t,tlkd->lkd", weights, summaries)
        cache.token_summaries[:] = list(summaries.unbind(1))  # L x (T, Hkv, D)
        return logits.view(1, t, -1)

    @staticmethod
    def _table(cache: KVCache) -> CacheDesc:
        return CacheDesc(cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity, int(cache.k.dtype == torch.float16))

    @staticmethod
    def _step(reads: DirectReads, slot: int, rope: RotaryTable, qsum: int, held: list[torch.Tensor]) -> StepDesc:
        """One token's StepDesc; the tensors it points into are appended to `held` (the caller keeps them alive)."""
        cos_plain, sin_plain = (t.contiguous() for t in reads.rope_q)  # (1, 1, 1, D)
        cos_new, sin_new = (t.contiguous() for t in (reads.rope_q_framed or reads.rope_q))
        slots, positions = reads.slots.contiguous(), reads.positions.contiguous()  # (m,) each
        held += [cos_plain, sin_plain, cos_new, sin_new, slots, positions]
        return StepDesc(
            cos_new.data_ptr(),
            sin_new.data_ptr(),
            cos_plain.data_ptr(),
            sin_plain.data_ptr(),
            slot,
            slots.numel(),
            reads.split,
            slots.data_ptr(),
            positions.data_ptr(),
            rope.cos.data_ptr(),  # (P, D) contiguous fp32
            rope.sin.data_ptr(),
            qsum,
        )

    def _work(self, partial_floats: int) -> _Work:
        """This thread's working buffers, grown to hold `partial_floats` of the attention's partial sums. Per thread, not per
        decoder: forked backends share the model and its decoder, and ctypes lets their threads run at once."""
        work: _Work | None = getattr(self._local, "work", None)
        if work is None or work.partial.numel() < partial_floats:
            grown = max(partial_floats, 2 * work.partial.numel() if work is not None else 0)
            work = _Work(torch.empty(self.desc.hidden), torch.empty(self.scratch_floats), torch.empty(grown))
            self._local.work = work
        return work


def plan_rows(cache: KVCache, batch: SlotBatch, rope: RotaryTable) -> list[DirectReads]:
    """The reads of each token of a one-row step of T tokens (decode_rows): token t attends to the slots its row of
    the mask lets it see (the table and the step's earlier tokens), as a one-token step would."""
    return [
        cache.plan_direct(
            dataclasses.replace(
                batch,
                positions=batch.positions[:, i : i + 1],  # (1, 1)
                write_slots=batch.write_slots[:, i : i + 1],  # (1, 1)
                mask=batch.mask[:, :, i : i + 1],  # (1, 1, 1, S')
                summary_weights=None,
            ),
            rope,
        )
        for i in range(batch.positions.shape[1])
    ]
