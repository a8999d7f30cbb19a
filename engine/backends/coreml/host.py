"""The host side of a converted bundle, shared by the Core ML runtime and the reference interpreter.

`PackageBackend` implements the engine's Backend protocol over "something that runs one function of one program
against a per-row state": it looks the embedding up on the host (mmap), splits each step into calls of the
bundle's fixed token counts, computes the RoPE tables, the additive mask and the one-hot write matrix, runs the
layer chunks in order, runs the head only on the rows whose logits are used, and maps read_kv / write_kv onto the
chunks' (L_chunk, Hkv, S, D) states, which are the canonical KV layout split by layers.

Pictures: ids at or above the vocabulary are a picture's tokens (engine.vision.model). The host embeds them through
an injected `PictureRows` (`take_pictures`), in fp16 as the text rows; without one, or for an id it does not hold,
the step is refused in one sentence. A step of text ids only is embedded exactly as before.

After every forward, `query_summary()` returns (B, L, Hkv, D) fp32: per layer, the mean pre-RoPE query over the
step's tokens and the query heads of each KV group (what the cascade's retrieval scores blocks against).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.backends.base import CANONICAL_KV_DTYPE, Backend
from engine.backends.coreml.bundle import HEAD, Bundle, chunk_name
from engine.backends.coreml.embedding import HostEmbedding
from engine.backends.coreml.errors import PackageError
from engine.backends.coreml.programs import MASK_MIN, STATE_NAMES, has_local_inputs
from engine.model.attention import rope_cos_sin
from engine.model.config import ModelConfig
from engine.model.network import ForwardCancelled, SlotBatch
from engine.vision.model import ImageInputError
from engine.vision.siglip import Tower

# ids (n,) int64, each at or above the vocabulary -> their rows (n, C), any float dtype (the host casts to fp16);
# ImageInputError for an id it does not hold.
PictureRows = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Call:
    """One function call: step rows [row0, row0 + size)."""

    function: str
    row0: int
    size: int


def plan_calls(n: int, functions: dict[str, int]) -> list[Call]:
    """Split n rows greedily into the available token counts (64, 8, 1 ...), in order.

    Calls execute in order, so a token attends before later calls of the same step are written. That matches the
    torch engine (which writes the whole step first) whenever no token may attend a slot written by a later token
    of the same step, which holds for every causal plan the cascade makes.
    """
    sizes = sorted(((t, name) for name, t in functions.items()), reverse=True)
    if not sizes or sizes[-1][0] != 1:
        raise PackageError("The bundle has no single-token function, so it cannot run an arbitrary step.")
    calls, at = [], 0
    while at < n:
        size, name = next((s, f) for s, f in sizes if s <= n - at)
        calls.append(Call(name, at, size))
        at += size
    return calls


class RopeHost:
    """cos/sin of arbitrary positions, computed exactly as engine.model.network.RotaryTable does (fp32, then fp16);
    `local`: the sliding-window layers' own rope (Gemma 3's unscaled local base), as RotaryTable's second kind."""

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        if local and config.rope_local_theta is not None:
            config = replace(config, rope_theta=config.rope_local_theta, rope_scaling=None, rope_freq_factors=None)
        self.config = config

    def __call__(self, positions: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """positions (N,) long -> cos, sin (N, D) fp16."""
        cos, sin = rope_cos_sin(self.config, positions)  # (N, D) fp32 each
        return cos.to(torch.float16).numpy(), sin.to(torch.float16).numpy()


def write_matrix(slots: list[int], num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """slots (T,) -> write (1, 1, S, T) one-hot and keep (1, 1, S, 1)."""
    if len(set(slots)) != len(slots):
        raise ValueError("a step writes one slot twice")
    write = np.zeros((1, 1, num_slots, len(slots)), np.float16)
    write[0, 0, slots, np.arange(len(slots))] = 1
    keep = (1 - write.sum(axis=-1, keepdims=True)).astype(np.float16)
    return write, keep


class PackageBackend(Backend):
    """Backend over a converted bundle; subclasses run functions and move state."""

    config: ModelConfig
    bundle: Bundle
    functions: dict[str, int]  # function name -> tokens per call
    slots: int
    _summary: torch.Tensor | None = None  # the last forward's query summary (the cascade reads query_summary())
    pictures: PictureRows | None = None  # a picture's rows (engine.vision.model.attach_vision), None for text only

    def take_pictures(self, rows: PictureRows) -> None:
        """Embed ids at or above the vocabulary through `rows` (engine.vision.model.PictureHost)."""
        self.pictures = rows

    def picture_tower(self, tower: Tower) -> tuple[Tower, str]:
        """The tower this host's pictures run on and where (engine.vision.model.PictureHost): here `tower` itself,
        in PyTorch on the CPU; the Core ML runtime runs its encoder program where it has one."""
        return tower, "vision encoder: PyTorch cpu float32"

    def query_summary(self) -> torch.Tensor | None:
        """Backend protocol: the per-layer query summary of the last forward, (B, L, Hkv, D) fp32."""
        return self._summary

    def _setup_host(self, bundle: Bundle) -> None:
        self.bundle = bundle
        self.config = bundle.config
        self.fingerprint = str(bundle.provenance["fingerprint"])
        self.functions = dict(bundle.functions)
        self.slots = bundle.slots
        self.chunks = [chunk_name(i) for i in range(len(bundle.chunks))]
        self.chunk_layers = [b - a for a, b in bundle.chunks]
        self.rope = RopeHost(self.config)
        self.local_rope = RopeHost(self.config, local=True) if has_local_inputs(self.config) else None
        self.embedding = HostEmbedding(bundle)
        # Gemma 3 scales its embeddings by sqrt(C) in the weights' dtype (engine.model.network.Transformer)
        self.embed_scale = np.float16(self.config.hidden_size**0.5) if self.config.scale_embeddings else None

    # -------------------------------------------------------------- what a subclass provides
    @abstractmethod
    def _predict(self, row: int, program: str, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run `function` of `program` (a chunk on row `row`'s state, or the stateless head)."""

    @abstractmethod
    def _read_state(self, row: int, program: str, name: str) -> np.ndarray:
        """The whole state `name` of a chunk for row `row`, (L_chunk, Hkv, S, D) fp16."""

    @abstractmethod
    def _write_state(self, row: int, program: str, name: str, value: np.ndarray) -> None:
        """Replace the whole state; value (L_chunk, Hkv, S, D) fp16."""

    # -------------------------------------------------------------- Backend
    @property
    def num_slots(self) -> int:
        return self.slots

    def _layers(
        self,
        tokens: torch.Tensor,
        batch: SlotBatch,
        row: int,
        call: Call,
        k_rope: tuple[np.ndarray, np.ndarray],
        k_rope_l: tuple[np.ndarray, np.ndarray] | None,
        should_stop: Callable[[], bool] | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run every chunk for one call: -> hidden (1, C, 1, T) fp16 and qsum (L, Hkv, D) fp32 (mean over T).
        `should_stop` is polled before every chunk but the forward's first (Backend.forward)."""
        rows = slice(call.row0, call.row0 + call.size)
        q_cos, q_sin = self.rope(batch.positions[row, rows])  # (T, D) each
        write, keep = write_matrix(batch.write_slots[row, rows].tolist(), self.slots)
        mask = batch.mask[row, 0, rows].numpy()  # (T, S) bool
        embedded = self._embed(tokens[row, rows].numpy())  # (T, C) fp16
        if self.embed_scale is not None:
            embedded = embedded * self.embed_scale  # fp16 times fp16, rounded to fp16 as torch does
        hidden = np.ascontiguousarray(embedded.T[None, :, None, :])  # (1, C, 1, T)
        local: dict[str, np.ndarray] = {}
        if self.local_rope is not None and k_rope_l is not None:
            q_cos_l, q_sin_l = self.local_rope(batch.positions[row, rows])  # (T, D) each
            # a sliding layer sees its window only (SlotBatch.local_mask; None: the same as the mask)
            mask_l = mask if batch.local_mask is None else batch.local_mask[row, 0, rows].numpy()  # (T, S) bool
            local = {
                "q_cos_l": q_cos_l[None, None],
                "q_sin_l": q_sin_l[None, None],  # (1, 1, T, D)
                "k_cos_l": k_rope_l[0][None, None],
                "k_sin_l": k_rope_l[1][None, None],  # (1, 1, S, D)
                "mask_l": np.where(mask_l, 0.0, MASK_MIN).astype(np.float16)[None, None],  # (1, 1, T, S)
            }
        fixed = {
            "q_cos": q_cos[None, None],
            "q_sin": q_sin[None, None],  # (1, 1, T, D)
            "k_cos": k_rope[0][None, None],
            "k_sin": k_rope[1][None, None],  # (1, 1, S, D)
            "mask": np.where(mask, 0.0, MASK_MIN).astype(np.float16)[None, None],  # (1, 1, T, S) additive
            "write": write,
            "keep": keep,
            **local,
        }
        summaries = []
        for i, chunk in enumerate(self.chunks):
            if (i or call.row0) and should_stop is not None and should_stop():
                raise ForwardCancelled
            out = self._predict(row, chunk, call.function, {"hidden": hidden, **fixed})
            hidden = np.asarray(out["hidden_out"], dtype=np.float16)
            summaries.append(np.asarray(out["qsum"], dtype=np.float32)[0])  # (L_chunk, Hkv, D)
        return hidden, np.concatenate(summaries, axis=0)

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        """ids (T,) -> (T, C) fp16: text rows from the host embedding, a picture's from `pictures`."""
        image = ids >= self.embedding.vocab
        if not image.any():
            return self.embedding(ids)
        if self.pictures is None:
            raise ImageInputError("The prompt holds image tokens but this model has no picture attached to embed them.")
        out = self.embedding(np.where(image, 0, ids))
        rows = np.asarray(self.pictures(ids[image].astype(np.int64)))
        if rows.shape != (int(image.sum()), self.embedding.hidden):
            raise ImageInputError(
                f"The vision encoder gave rows of shape {rows.shape}, not one of {self.embedding.hidden} a token."
            )
        out[image] = rows.astype(np.float16)
        return out

    def _head(self, hidden: np.ndarray) -> np.ndarray:
        """hidden (n, C) fp16 -> logits (n, V) fp32, in calls of the head's token counts."""
        out = []
        for call in plan_calls(hidden.shape[0], self.functions):
            h = np.ascontiguousarray(hidden[call.row0 : call.row0 + call.size].T[None, :, None, :])  # (1, C, 1, T)
            res = self._predict(-1, HEAD, call.function, {"hidden": h})
            out.append(
                np.concatenate([np.asarray(res[f"logits_{i}"]) for i in range(len(self.bundle.vocab_pieces))], axis=-1)[
                    0
                ]
            )
        return np.concatenate(out, axis=0).astype(np.float32)

    def forward(
        self,
        tokens: torch.Tensor,
        batch: SlotBatch,
        last_only: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        b, t = tokens.shape
        if b != self.batch:
            raise ValueError(f"forward got {b} rows but the slot table has {self.batch}")
        live = batch.slot_positions.shape[-1]
        if live > self.slots:
            raise ValueError(f"the plan covers {live} slots but the bundle has {self.slots}")
        if live < self.slots:
            # Only the leading S' slots take part (SlotBatch); the fixed-shape program sees the rest masked off.
            pad = self.slots - live
            batch = SlotBatch(
                batch.positions,
                batch.write_slots,
                torch.nn.functional.pad(batch.slot_positions, (0, pad)),
                torch.nn.functional.pad(batch.mask, (0, pad), value=False),
                local_mask=None
                if batch.local_mask is None
                else torch.nn.functional.pad(batch.local_mask, (0, pad), value=False),
            )
        rows_out, summaries = [], []
        for row in range(b):
            k_rope = self.rope(batch.slot_positions[row])  # (S, D) each, once per step
            k_rope_l = self.local_rope(batch.slot_positions[row]) if self.local_rope is not None else None
            hidden, qsum = (
                [],
                np.zeros(
                    (self.config.num_hidden_layers, self.config.num_key_value_heads, self.config.head_dim), np.float32
                ),
            )
            for call in plan_calls(t, self.functions):
                h, q = self._layers(tokens, batch, row, call, k_rope, k_rope_l, should_stop)
                hidden.append(h[0, :, 0, :].T)  # (T_call, C)
                qsum += q * (call.size / t)
            final = np.concatenate(hidden, axis=0)  # (T, C)
            rows_out.append(self._head(final[-1:] if last_only else final))  # only the logits that are used
            summaries.append(qsum)
        self._summary = torch.from_numpy(np.stack(summaries))  # (B, L, Hkv, D) fp32
        return torch.from_numpy(np.stack(rows_out))  # (B, T, V) or (B, 1, V) fp32

    def _chunk_of_layers(self) -> list[tuple[str, int]]:
        return list(zip(self.chunks, self.chunk_layers, strict=True))

    def read_kv(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = slots.numpy()
        out = []
        for name in STATE_NAMES:
            parts = [
                np.asarray(self._read_state(row, chunk, name), dtype=np.float16)[:, :, idx] for chunk in self.chunks
            ]
            out.append(torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=0))).to(CANONICAL_KV_DTYPE))
        return out[0], out[1]  # (L, Hkv, n, D) each

    def write_kv(self, row: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        idx = slots.numpy()
        for name, new in zip(STATE_NAMES, (k, v), strict=True):
            layers = new.to(torch.float16).numpy()  # (L, Hkv, n, D)
            at = 0
            for chunk, n in self._chunk_of_layers():
                state = np.array(self._read_state(row, chunk, name), dtype=np.float16)  # a private copy
                state[:, :, idx] = layers[at : at + n]
                self._write_state(row, chunk, name, state)
                at += n
