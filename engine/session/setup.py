"""What an `Engine` (engine.session.engine) is opened with: each conversation's memory factory, the check that a loaded
model fits the machine, and the backend wrapper that serializes forwards on shared weights.

Sizes come from the backend itself (its resident weight bytes, the bytes one slot of its table takes) and from the
slot table the cascade will really build, not from guesses per backend name.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch

from engine.backends.base import Backend, BackendWrapper
from engine.hw import HardwarePolicy
from engine.loading.model_files import resolve_model_path, settings_dir
from engine.memory.base import Memory
from engine.memory.cascade import CascadeConfig, CascadeMemory, PersistentStore, SharedBudget
from engine.memory.cascade.pictures import PictureTokens
from engine.model.slots import SlotBatch
from engine.paths import default_cache_dir
from engine.session.replay import FeedLog

log = logging.getLogger(__name__)
MemoryFactory = Callable[[Backend], Memory]
# The least slot table a memory budget shrinks a conversation to (its window grows into what the budget leaves,
# up to the trained context).
MIN_SLOT_TABLE = 1024


def slot_table_limit(policy: HardwarePolicy | None, backend: Backend) -> int | None:
    """The most slots a conversation's table may take: what the backend runs (a Core ML program's fixed slot count)
    and half of what the budget leaves beside the weights, never below MIN_SLOT_TABLE; None (the trained context
    decides) when neither limits it."""
    if policy is None:
        return backend.max_slots
    spare = max(0, policy.budget_bytes() - backend.weight_bytes)
    budget = max(MIN_SLOT_TABLE, spare // 2 // backend.slot_bytes_per_token())
    return budget if backend.max_slots is None else min(backend.max_slots, budget)


def check_fits(policy: HardwarePolicy, backend: Backend, model_path: Path) -> None:
    """InsufficientMemory (one sentence) unless the backend's weights and one conversation's slot table, as the
    cascade lays it out for this model, fit the machine."""
    geometry = CascadeConfig.for_model(
        settings_dir(model_path), backend.config, max_slots=slot_table_limit(policy, backend)
    )
    policy.check_model_fits(backend.weight_bytes, geometry.num_slots * backend.slot_bytes_per_token())


@dataclass(frozen=True)
class CascadeFactory:
    """memory_factory_for's factory: a MemoryFactory (called with a backend, and a row where a scheduler names one)
    whose memories reserve retrieval room for a picture of `picture_tokens` (CascadeConfig.fit_to; 0: none)."""

    build: Callable[[Backend, int, int], Memory]  # (backend, row, picture tokens) -> the memory
    picture_tokens: int = 0

    def __call__(self, backend: Backend, row: int = 0) -> Memory:
        return self.build(backend, row, self.picture_tokens)

    def for_pictures(self, picture_tokens: int) -> CascadeFactory:
        """The same memories, with room to recall a picture of `picture_tokens` tokens whole."""
        return replace(self, picture_tokens=picture_tokens)


def memory_factory_for(
    model_dir: str | Path | None,
    *,
    cache_dir: Path | None = None,
    prefix_cache: bool = True,
    policy: HardwarePolicy | None = None,
    shared_budget: SharedBudget | None = None,
    **cascade_overrides: Any,
) -> CascadeFactory:
    """Each conversation's memory: the cascade laid out per the model's cascade.json, over one persistent
    (L3) store per model + backend numerics under `cache_dir` (default: the platform cache dir). With a `policy`,
    the slot table and the episodic tier get their share of the machine's memory budget instead of the defaults.
    Every memory it makes (the app's conversations, the server's rows) shares one episodic budget: `shared_budget`,
    else one of the first memory's episodic budget, so many conversations hold no more episodic KV than one may."""
    model_path = resolve_model_path(model_dir)
    shared: list[SharedBudget] = [shared_budget] if shared_budget is not None else []
    stores: dict[tuple[str, str], PersistentStore] = {}
    stores_lock = threading.Lock()

    def store_for(backend: Backend, config: CascadeConfig) -> PersistentStore | None:
        if not prefix_cache:
            return None
        key = (backend.fingerprint, backend.numerics)
        with stores_lock:
            if key not in stores:
                root = (cache_dir or default_cache_dir() / "kv") / backend.fingerprint[:16]
                stores[key] = PersistentStore(
                    root, backend.fingerprint, backend.numerics, config.persistent_budget_bytes
                )
            return stores[key]

    said: list[int] = []  # picture sizes the trained context could not make room for, said once each

    def make(backend: Backend, row: int, picture_tokens: int) -> Memory:  # row: as a scheduler's RowMemoryFactory
        limit = slot_table_limit(policy, backend)
        config = CascadeConfig.for_model(
            settings_dir(model_path), backend.config, limit, picture_tokens, **cascade_overrides
        )
        if not config.holds_pictures(picture_tokens) and picture_tokens not in said:
            said.append(picture_tokens)
            log.warning(
                "The model's trained context or the memory budget leaves no room to recall its largest picture "
                "(%d tokens, %d blocks of %d) whole, so an evicted picture comes back block by block.",
                picture_tokens,
                config.picture_blocks(picture_tokens),
                config.block_size,
            )
        if policy is not None and "episodic_budget_bytes" not in cascade_overrides:
            working = config.num_slots * backend.slot_bytes_per_token()
            config = replace(config, episodic_budget_bytes=policy.episodic_budget_bytes(backend.weight_bytes, working))
        with stores_lock:
            if not shared:
                shared.append(SharedBudget(config.episodic_budget_bytes))
        return CascadeMemory(backend, config, row=row, store=store_for(backend, config), shared_budget=shared[0])

    return CascadeFactory(make)


def seeing_pictures(factory: MemoryFactory, pictures: PictureTokens, max_picture_tokens: int = 0) -> MemoryFactory:
    """`factory`'s memories (called as it is: with a backend, and a row where a scheduler names one), each told
    which ids are pictures' tokens, so a memory that can keeps each picture a unit (engine.memory.cascade.pictures);
    a cascade's laid out with retrieval room for a picture of `max_picture_tokens` (the model's largest)."""
    if isinstance(factory, CascadeFactory) and max_picture_tokens:
        factory = factory.for_pictures(max_picture_tokens)
    make_inner = cast(Callable[..., Memory], factory)

    def make(backend: Backend, *row: int) -> Memory:
        memory = make_inner(backend, *row)
        see: Callable[[PictureTokens], None] | None = getattr(memory, "see_pictures", None)
        if see is not None:
            see(pictures)
        return memory

    return make


@dataclass
class TokenCounter:
    """Tokens a session's forwards computed (prompts, replays, decoding steps): `read_tokens` in `generate --json`,
    and how the tests see that a conversation handed back its memory computed nothing."""

    count: int = 0


class LockedBackend(BackendWrapper):
    """A backend whose every forward takes the engine's step lock (the lock is held for one step only), and
    records each forward's size in the session's feed log (what a compact session file replays) and its counter."""

    def __init__(
        self,
        inner: Backend,
        lock: threading.Lock,
        log: FeedLog | None = None,
        memory: Memory | None = None,
        counter: TokenCounter | None = None,
    ) -> None:
        super().__init__(inner)
        self._lock, self._log, self._memory, self._counter = lock, log, memory, counter

    def fork(self) -> Backend:
        # A fork (a beam) steps under the same lock and counts for the same session (no feed log).
        return LockedBackend(self.inner.fork(), self._lock, counter=self._counter)

    def forward(
        self,
        tokens: torch.Tensor,
        batch: SlotBatch,
        last_only: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        with self._lock:
            out = self.inner.forward(tokens, batch, last_only, should_stop)  # a cancelled one is not logged
        if self._counter is not None:
            self._counter.count += int(tokens.numel())
        if self._log is not None and self._memory is not None:
            # Only a speculative verify asks for every position's logits (engine.generation.loop.verify_forward).
            verify = not last_only and int(tokens.shape[-1]) > 1
            self._log.record_feed(len(self._memory.tokens), int(tokens.shape[-1]), verify)  # tokens: (1, n)
        return out
