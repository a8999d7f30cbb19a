"""The backend protocol: run the model over a fixed slot table, and read/write KV slots.

Every backend (coreml, mps, cuda, cpu) implements the same small surface, so the memory cascade, sessions and the
scheduler never know which one runs. KV crosses the boundary in one canonical layout: fp16 on the host,
(L, Hkv, n, D) per sequence row — what episodic memory keeps, what L3 stores and what session files hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.errors import BackendUnavailable, SparkError
from engine.model.config import ModelConfig
from engine.model.kv_types import KVType
from engine.model.slots import SlotBatch

CANONICAL_KV_DTYPE = torch.float16


@dataclass(frozen=True)
class BackendProbe:
    """Whether a backend can run here, and if not, the sentence saying why."""

    name: str
    available: bool
    reason: str


class PartTimer(Protocol):
    """What a profiler gives a backend to time the parts of its forward (engine.generation.profiler)."""

    def open_part(self, name: str) -> None: ...  # "embedding", "layer.{i}.attention", "layer.{i}.mlp", "lm_head"

    def close_part(self) -> None: ...

    def native_step(self) -> AbstractContextManager[object]: ...  # one native decoding step (every layer at once)


class Backend(ABC):
    """A loaded model plus its device slot table of shape (L, B, Hkv, S, D)."""

    name: str
    config: ModelConfig
    fingerprint: str
    weight_bytes: int  # bytes the loaded weights occupy where they run, as this backend holds them
    quantize: str = "none"  # the weight storage it runs (engine.backends.QUANTIZE_CHOICES; "none": its own precision)
    kernels_note: str = ""  # which kernels run the weights and why, where the backend chose among several
    # Whether `forward` takes tokens for the leading rows only, (B' <= B, T): a batch with its busy rows first
    # then costs B' rows, not B (the scheduler's rows fill from row 0).
    runs_leading_rows: bool = False
    # The largest slot table this backend runs (None: any). The cascade fits its geometry to it, as to the memory
    # budget: Core ML runs a fixed-shape program converted for one slot count (coreml.convert.ANE_MAX_SLOTS).
    max_slots: int | None = None
    # What the slot table holds keys and values in (engine.model.kv_types): fp16 unless the backend offers q8_0.
    kv_type: KVType = KVType.F16

    @property
    @abstractmethod
    def numerics(self) -> str:
        """Identifies the arithmetic (backend, device, dtype): L3 entries are only reused under equal numerics."""

    @property
    @abstractmethod
    def batch(self) -> int: ...

    @property
    def verify_pays(self) -> bool:
        """Whether a speculative verify of a few tokens costs so little against as many decoding steps here that
        prompt lookup speeds up greedy replies, open chat included, as `bench speculative` measured: `auto`
        speculation drafts only where it does (engine.generation.speculative `resolve`). This default: not measured."""
        return False

    def set_kv_type(self, kv_type: KVType) -> None:
        """Hold keys and values as `kv_type` (a backend just opened, its table empty). BackendUnavailable, in one
        sentence, where this backend cannot."""
        if kv_type is not KVType.F16:
            raise BackendUnavailable(
                f"The {self.name} backend holds keys and values in fp16 only, not {kv_type.value}."
            )

    @property
    @abstractmethod
    def num_slots(self) -> int: ...

    @abstractmethod
    def allocate(self, batch: int, num_slots: int) -> None:
        """(Re)create an empty slot table with `batch` rows of `num_slots` slots."""

    def widen(self, num_slots: int) -> None:
        """Let rows address up to `num_slots` slots, keeping what the table holds (beam search's forks write past
        their memory's slots: engine.model.slots.ForkTable). A fixed-shape table (Core ML) cannot."""
        raise SparkError(f"The {self.name} backend's slot table has a fixed shape, so it cannot run beam search.")

    @abstractmethod
    def fork(self) -> Backend:
        """A backend sharing these weights with its own empty slot table (another conversation, same model)."""

    @abstractmethod
    def forward(
        self,
        tokens: torch.Tensor,
        batch: SlotBatch,
        last_only: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) long -> logits float32 on the host, (B, T, V) or (B, 1, V) with `last_only`.

        Writes the new tokens' K/V into `batch.write_slots` before attending (see engine.model.slots.SlotBatch).
        `should_stop` is polled between layers (or between the pieces of a forward that runs as a few opaque calls);
        when it turns true the forward raises engine.model.network.ForwardCancelled, having written some layers'
        K/V into the write slots: the caller takes the step back (engine.memory.base.Memory.rollback).
        """

    def position_offsets(self, tokens: Sequence[int], new: int) -> torch.Tensor | None:
        """(new, 3) long: the multimodal rotary offsets of the last `new` of a conversation's `tokens` (every token
        from its first), what a memory puts in its plan (SlotBatch.offsets); None where the model has none or the
        conversation holds no picture. Only a model that sees images through engine.vision has any."""
        return None

    @abstractmethod
    def read_kv(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots (n,) long -> k, v each (L, Hkv, n, D) in CANONICAL_KV_DTYPE on the host (keys unrotated)."""

    @abstractmethod
    def write_kv(self, row: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Inverse of read_kv: k, v (L, Hkv, n, D) canonical -> the device slots of `row`."""

    def query_summary(self) -> torch.Tensor | None:
        """The last forward's query summary, an extra output of that same forward (never a pass of its own):
        (B, L, Hkv, D) float32 on the host; for each row and layer, the mean of the pre-RoPE queries (after q_proj
        and its bias) over the step's tokens and over the query heads of each KV-head group. None from a backend
        that does not produce one (the cascade then routes with a key proxy)."""
        return None

    def token_summaries(self) -> torch.Tensor | None:
        """Per token, the last forward's query summary when it ran one row of a few tokens (a speculative verify):
        (T, L, Hkv, D) float32 on the host, token t's as `query_summary` gives a forward of that token alone. A
        verify keeps the summaries of the tokens it accepts, as decoding them one by one would. None from a backend
        that does not produce them (the cascade then keeps a verify's summary only when it accepted every draft)."""
        return None

    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's k and v in the canonical layout: what the memory tiers, L3 and session files hold."""
        c = self.config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * CANONICAL_KV_DTYPE.itemsize

    def slot_bytes_per_token(self) -> int:
        """Bytes one slot of one row takes in this backend's own slot table: its KV plus whatever it keeps beside
        it. This default is a table holding the canonical KV and nothing else (Core ML's fp16 state)."""
        return self.kv_bytes_per_token()

    def timed_parts(self, timer: PartTimer) -> AbstractContextManager[None]:
        """Within the block, the forward reports its parts to `timer`; a backend whose forward is one opaque call
        (Core ML, a remote server) reports nothing and the profiler counts the whole call as one part."""
        return nullcontext()

    def kv_resident_bytes(self) -> int:
        """Bytes the slot table holds now. This default is a table allocated whole (Core ML's fixed-shape state);
        a table that grows with the conversation (the PyTorch backends) reports what it has grown to, of which the
        CPU's keeps resident only the pages steps have written (engine.model.slots.lazy_zeros)."""
        return self.batch * self.num_slots * self.slot_bytes_per_token()

    def release(self) -> None:  # noqa: B027  # deliberately a no-op by default: a fixed-shape table stays
        """Give the slot table's memory back while no conversation uses it (an idle row, a finished one); the
        memory that used it must reset before the next forward. A fixed-shape table (Core ML) keeps its state."""

    def expect(self, slots: int) -> None:  # noqa: B027  # a hint: nothing to do for a table allocated whole
        """A prompt about to be read and its reply will use the slots [0, `slots`) (Memory.slots_after): a table
        that grows with the conversation grows once for them rather than step by step (each growth holds two
        tables at once)."""


class BackendWrapper(Backend):
    """Another backend with something around it (a lock, a timer, a hidden slot): every member goes to `inner`
    unless a subclass overrides it. Written out member by member, so the type checker sees the whole surface and a
    member added to Backend must be added here too (the class cannot be instantiated until it is)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name, self.config, self.fingerprint = inner.name, inner.config, inner.fingerprint
        self.weight_bytes, self.quantize, self.kernels_note = inner.weight_bytes, inner.quantize, inner.kernels_note
        self.runs_leading_rows, self.max_slots = inner.runs_leading_rows, inner.max_slots
        self.kv_type = inner.kv_type

    @property
    def numerics(self) -> str:
        return self.inner.numerics

    @property
    def verify_pays(self) -> bool:
        return self.inner.verify_pays

    @property
    def batch(self) -> int:
        return self.inner.batch

    def set_kv_type(self, kv_type: KVType) -> None:
        self.inner.set_kv_type(kv_type)
        self.kv_type = self.inner.kv_type

    @property
    def num_slots(self) -> int:
        return self.inner.num_slots

    def allocate(self, batch: int, num_slots: int) -> None:
        self.inner.allocate(batch, num_slots)

    def widen(self, num_slots: int) -> None:
        self.inner.widen(num_slots)

    def fork(self) -> Backend:
        return self.inner.fork()

    def forward(
        self,
        tokens: torch.Tensor,
        batch: SlotBatch,
        last_only: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        return self.inner.forward(tokens, batch, last_only, should_stop)

    def position_offsets(self, tokens: Sequence[int], new: int) -> torch.Tensor | None:
        return self.inner.position_offsets(tokens, new)

    def read_kv(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read_kv(row, slots)

    def write_kv(self, row: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.write_kv(row, slots, k, v)

    def query_summary(self) -> torch.Tensor | None:
        return self.inner.query_summary()

    def token_summaries(self) -> torch.Tensor | None:
        return self.inner.token_summaries()

    def kv_bytes_per_token(self) -> int:
        return self.inner.kv_bytes_per_token()

    def slot_bytes_per_token(self) -> int:
        return self.inner.slot_bytes_per_token()

    def timed_parts(self, timer: PartTimer) -> AbstractContextManager[None]:
        return self.inner.timed_parts(timer)

    def kv_resident_bytes(self) -> int:
        return self.inner.kv_resident_bytes()

    def release(self) -> None:
        self.inner.release()

    def expect(self, slots: int) -> None:
        self.inner.expect(slots)
