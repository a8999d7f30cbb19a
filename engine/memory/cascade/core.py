"""CascadeMemory: engine.memory.base.Memory over the three tiers, composed of one object per responsibility:

- WorkingMemory (L1, engine.memory.cascade.working): the slot table's layout, positions and mask;
- EpisodicMemory (L2, engine.memory.cascade.episodic): evicted KV in blocks, their key bounds and budget;
- Retriever (engine.memory.cascade.retrieval): the routing query, when to re-route, paging blocks into retrieval groups;
- PrefixCache (engine.memory.cascade.prefix): prefix digests, exact prefix blocks and cascade snapshots in L3
  (engine.memory.cascade.persistent's PersistentStore).

Per plan (before each forward), in this order:
  1. route (Retriever.route): each layer's retrieval groups get its most relevant blocks, when the routing
     strategy says so;
  2. assign slots to the new tokens; tokens pushed out of the window are read (read_kv) *before* the forward
     overwrites them; once the forward is done (after_forward) they join the current partial episodic block, and
     a forward stopped midway (rollback of the whole plan) writes them back into their slots instead;
  3. positions and the mask come from the working memory's preallocated tables.
A plan may hold at most `window` tokens: with more, a new token would overwrite one fed in the same forward,
whose KV does not exist yet. Within one chunk that wraps the window, earlier tokens of the chunk see the window
as it is after the whole chunk is written (at least W - T + 1 window tokens instead of W).

Pictures (given `PictureTokens`, engine.memory.cascade.pictures) are units: when the window's edge would fall
inside a picture's span, the whole picture leaves with the tokens the plan pushes out (`WorkingMemory.release`),
and the text after it up to the next block boundary where those tokens are already fed, so its episodic blocks
are complete at once; the window then holds fewer than `window` tokens until new ones fill it. A prompt's chunks
end at each picture's end (prefill_cut), so no plan pushes out part of a picture while it feeds the rest: a
picture no longer than the window is always wholly in it or wholly out. A longer one, or one fed in chunks that
ignored the cuts, leaves in pieces as text does. Retrieval brings a picture's blocks back together
(engine.memory.cascade.retrieval).

A state (state(), load_state()) depends on the model, its numerics and CascadeConfig.state_settings() (the
geometry and routing settings, never the budgets): it restores on any machine with the same model, under that
machine's budgets.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.backends.base import Backend
from engine.errors import InputTooLarge, SessionFileError, SparkError
from engine.memory.base import ForkView, RowPlan, window_mask
from engine.memory.cascade.budget import SharedBudget
from engine.memory.cascade.config import AUTO_WINDOW, CascadeConfig
from engine.memory.cascade.episodic import ADOPTED_BASE, EpisodicMemory, PagedBlocks
from engine.memory.cascade.lexical import LexicalIndex
from engine.memory.cascade.migrate import migrate_state
from engine.memory.cascade.persistent import PersistentStore
from engine.memory.cascade.pictures import PictureSpans, PictureTokens
from engine.memory.cascade.prefix import PrefixCache
from engine.memory.cascade.retrieval import Retriever
from engine.memory.cascade.state_schema import CASCADE_STATE_VERSION, check_cascade_state
from engine.memory.cascade.stats import CascadeStats, Counters, TierStats
from engine.memory.cascade.working import WorkingMemory
from engine.memory.values import SchemaError, StateTarget
from engine.model.network import ROTARY_HEADROOM

STATE_VERSION = CASCADE_STATE_VERSION  # 2: per-layer retrieval groups, key bounds, query-summary routing (engine.memory.cascade.migrate)
TAIL_STEP = 4  # a prompt's last TAIL_STEPS * TAIL_STEP tokens go in small chunks, each routed by the one before
TAIL_STEPS = 6
TIERS = ("working", "episodic", "persistent")
FRAME_PERIOD_MAX = 4096


class CascadeMemory:
    """The memory of one sequence: row `row` of the backend's slot table, laid out per `config`."""

    def __init__(
        self,
        backend: Backend,
        config: CascadeConfig,
        row: int = 0,
        store: PersistentStore | None = None,
        shared_budget: SharedBudget | None = None,
        pictures: PictureTokens | None = None,
    ) -> None:
        """`shared_budget`: the episodic budget this memory shares with the others of its owner (a server's rows,
        an app's conversations), on top of its own (engine.memory.cascade.budget). `pictures`: which ids are
        pictures' tokens (a vision model's; see_pictures)."""
        if config.window == AUTO_WINDOW:
            raise ValueError("resolve the automatic window first (CascadeConfig.fit_to or for_model)")
        self.backend = backend
        self.row = row
        self.store = store
        self.shared_budget = shared_budget
        self.kv_token_bytes = backend.kv_bytes_per_token()
        # Blocks read elsewhere and attached (engine.documents): (first block id, key bounds min, max, L3 keys).
        # They outlive a reset (a new chat, an edited transcript), as the attachment does.
        self.attachments: list[tuple[int, torch.Tensor, torch.Tensor, list[str]]] = []
        self.lexical = LexicalIndex()  # their token ids, for the retrieval of the blocks a question names
        self.pictures = PictureSpans(pictures)  # where the conversation's pictures lie (kept as units)
        self._layout(config)

    def _layout(self, config: CascadeConfig) -> None:
        """Lay the memory out per `config` (empty), resizing a one-row slot table to it."""
        backend, c = self.backend, self.backend.config
        if backend.num_slots != config.num_slots:
            if backend.batch != 1 or self.row != 0:
                raise ValueError(
                    f"the backend's slot table has {backend.num_slots} slots; this cascade needs {config.num_slots}"
                )
            backend.allocate(1, config.num_slots)
        self.cfg = config
        # Frames stay inside the rotary table (the trained context + ROTARY_HEADROOM), and small: fp32 angles lose
        # precision as positions grow (a period of 4096 costs one full re-rotation of the window per 4096 tokens).
        table = c.max_position_embeddings + ROTARY_HEADROOM
        self.working = WorkingMemory(
            config, c.num_hidden_layers, frame_period=max(0, min(table - config.num_slots, FRAME_PERIOD_MAX))
        )
        kv_shape = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        laid_out: EpisodicMemory | None = getattr(self, "episodic", None)
        if self.shared_budget is not None and laid_out is not None:  # laid out again: the old store stops counting
            self.shared_budget.leave(laid_out)
        self.episodic = EpisodicMemory(config, kv_shape, self.store, self.shared_budget)
        self.retriever = Retriever(backend, self.row, config, self.working, self.episodic, self.lexical, self.pictures)
        self.prefix = PrefixCache(self.store, config)
        self.tokens: list[int] = []
        self._reset_state()

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def _reset_state(self) -> None:
        self.tokens = []
        self.pictures.reset()
        self.working.reset()
        self.episodic.reset()
        for first, kmin, kmax, keys in self.attachments:
            self.episodic.adopt(first, kmin, kmax, keys)
        self.retriever.reset()
        self.prefix.reset()
        self._last_fed = 0  # tokens of the last plan (its forward's query summary covers them)
        self._last_evicted = 0  # tokens the last plan pushed out of the window
        self._released = 0  # ... of which its WorkingMemory.release took (a picture leaving whole)
        # Their slots (e,) and KV (L, Hkv, e, D) each, read before the forward overwrote them, until after_forward
        self._evicted_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._verified = False  # the last plan was a speculative verify (rollback heard of it, maybe with 0)
        self._taken_back = False  # rollback took tokens of the last plan back (its query summary covers them)
        self.reused_tokens = 0  # how many leading tokens the last reuse_prefix restored (for stats and benches)

    def reset(self) -> None:
        self._reset_state()

    def see_pictures(self, pictures: PictureTokens) -> None:
        """From now on, ids `pictures` names are pictures' tokens (a vision model's memory; before any is fed)."""
        self.pictures.tokens = pictures
        self.pictures.load_state(None, self.tokens)

    def attach(
        self,
        kmin: torch.Tensor,
        kmax: torch.Tensor,
        keys: list[str],
        ids: list[int] | None = None,
        present: bool = False,
    ) -> int:
        """Blocks read elsewhere (a document's capsule, engine.documents) join episodic memory as pinned stubs:
        kmin, kmax (n, L, F) their key bounds, keys their KV's L3 entries, ids the token ids they hold (n whole
        blocks; for the lexical index, engine.memory.cascade.lexical). Returns the first block's id (the
        others follow). While anything is attached, the prefix cache is neither read nor written: this memory's
        KV depends on more than its tokens. `present`: a restored state already holds them (a full session file):
        they are pinned where they are, and only those its budgets let go are adopted again."""
        if self.store is None or not self.cfg.retrieval_blocks:
            raise SparkError("Attaching needs the cascade's retrieval and its persistent cache (no --no-prefix-cache).")
        want = (len(keys), *self.episodic.kmin.shape[1:])
        if tuple(kmin.shape) != want or tuple(kmax.shape) != want:
            raise SparkError("The attached memory was read by another model geometry; read it again.")
        if ids is not None and len(ids) != len(keys) * self.cfg.block_size:
            raise SparkError("The attached memory's tokens do not fill its blocks; read it again.")
        # After the last attachment's ids (not after their count): a detached one leaves a gap, never a reused id.
        first = max((a[0] + len(a[3]) for a in self.attachments), default=ADOPTED_BASE)
        if ids is not None:
            try:
                self.lexical.add(first, ids, self.cfg.block_size)
            except ValueError as exc:
                raise SparkError(f"The attached memory cannot be indexed: {exc}.") from None
        self.attachments.append((first, kmin, kmax, list(keys)))
        if not present:
            self.episodic.adopt(first, kmin, kmax, list(keys))
            return first
        for j, key in enumerate(keys):
            if first + j in self.episodic.blocks:
                self.episodic.pinned.add(first + j)
            else:
                self.episodic.adopt(first + j, kmin[j : j + 1], kmax[j : j + 1], [key])
        return first

    def detach(self, first: int) -> None:
        """The attachment whose block 0 is `first` leaves: its blocks are forgotten (their KV stays in L3 for
        others) and the retrieval groups emptied, so no slot still holds one; the next routing refills them."""
        for i, (start, _kmin, _kmax, keys) in enumerate(self.attachments):
            if start == first:
                del self.attachments[i]
                self.episodic.forget_adopted(first, len(keys))
                self.lexical.remove(first)
                self.working.set_groups([[] for _ in range(self.working.num_layers)])
                return
        raise KeyError(first)

    def invalidate(self, tier: str | None = None) -> None:
        """Drop a tier's contents ('working' forgets the conversation, as reset(); None: every tier)."""
        if tier not in (None, *TIERS):
            raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
        if tier in (None, "persistent") and self.store is not None:
            self.store.clear()
        if tier in (None, "working"):
            self._reset_state()
        elif tier == "episodic":
            self.episodic.drop_all()
            self.working.set_groups([[] for _ in range(self.working.num_layers)])

    # -- the Memory protocol ------------------------------------------------------------------------------------

    def plan(self, ids: list[int]) -> RowPlan:
        t = len(ids)
        if t == 0:
            raise ValueError("plan needs at least one token")
        if t > self.cfg.window:
            raise InputTooLarge(
                f"A step of {t} tokens exceeds the {self.cfg.window}-token window; feed it in smaller chunks."
            )
        if self.cfg.retrieval_blocks and self.episodic.blocks:
            self.retriever.route(prefill=t > 1, answering=t <= TAIL_STEP, fed=self.tokens)
        start = len(self.tokens)
        self._released = self._unit_release(t)
        released = self.working.release(self._released) if self._released else []
        slots, evicted = self.working.assign(t)
        evicted = released + evicted
        self._last_evicted = len(evicted)
        self._verified = self._taken_back = False
        self._evicted_kv = None
        if evicted:  # read before the forward overwrites them: episodic memory's, or put back by a rollback
            gone = torch.tensor(evicted)
            self._evicted_kv = (gone, *self.backend.read_kv(self.row, gone))
        self.prefix.feed(ids, start)
        self.tokens.extend(ids)
        self.pictures.feed(ids, start)
        self.retriever.since_route += t
        self._last_fed = t
        self.working.refresh_positions()
        ws = torch.tensor(slots, dtype=torch.long)  # (T,)
        w = self.working
        mask = w.mask(ws)  # (T, S)
        # Only the leading slots up to the last one attended take part (SlotBatch's S'): a prefill's attention then
        # costs what the memory holds, not the whole table.
        live = int(mask.any(0).nonzero()[-1]) + 1
        local = None
        if self.backend.config.sliding_window:  # its sliding layers see only their window, nothing retrieved
            queries = torch.arange(start, start + t)  # (T,)
            local = window_mask(mask[:, :live], w.slot_tokens()[:live], queries, self.backend.config.sliding_window)
        return RowPlan(
            w.slot_positions[ws],
            ws,
            w.slot_positions[:live].clone(),
            mask[:, :live],
            w.frame,
            w.window_start,
            local,
            self.backend.position_offsets(self.tokens, t),
        )

    def _unit_release(self, t: int) -> int:
        """How many of the window's oldest tokens leave before a plan of `t` tokens goes in: 0 unless the tokens it
        pushes out would end inside a picture; then through the picture, and on to the next block boundary where
        those tokens are fed and no other picture is cut there."""
        if not self.pictures.spans:
            return 0
        w, sinks = self.working, self.cfg.sink_tokens
        out = w.n_window + t - min(t, sinks - w.n_sink) - self.cfg.window  # what assign would push out
        if out <= 0:
            return 0
        first = sinks + w.evicted  # the window's oldest token
        span = self.pictures.cut(first + out)
        fed = len(self.tokens)
        if span is None or span[1] > fed:  # no picture cut, or one still being fed (longer than the window)
            return 0
        end = span[1]
        whole = sinks + -(-(end - sinks) // self.cfg.block_size) * self.cfg.block_size
        if whole <= fed and self.pictures.cut(whole) is None:
            end = whole
        return end - first

    def after_forward(self) -> None:
        if self._evicted_kv is not None:  # the forward is done: what it pushed out of the window is history now
            _, k, v = self._evicted_kv
            self._evicted_kv = None
            self.prefix.close()
            if self.cfg.retrieval_blocks:
                self.episodic.append(k, v)
        if self.cfg.retrieval_blocks:
            if self._verified:  # the accepted tokens' summaries, as decoding them one by one records them
                self.retriever.remember_tokens(self._last_fed, whole=not self._taken_back)
            else:
                self.retriever.remember_summary(self._last_fed)
        if self.attachments:  # its KV depends on the attachments, not only on its tokens: never cached as a prefix
            return
        self.prefix.persist(len(self.tokens), self._read_prefix)
        if self.prefix.due(len(self.tokens)):
            self.prefix.put_snapshot(self.episodic, self.state)

    def _read_prefix(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV (L, Hkv, n, D) of tokens [start, end) while nothing has been evicted."""
        slots = torch.tensor([self.working.slot_of(i) for i in range(start, end)])  # (n,)
        return self.backend.read_kv(self.row, slots)

    def reuse_prefix(self, ids: list[int]) -> int:
        """ids: a prompt less its last token. Only a state that a cold read of the prompt passes through is
        restored: a snapshot before the prompt's tail (engine.memory.cascade.prefix)."""
        return self._reuse(ids, len(ids) - TAIL_STEP * TAIL_STEPS)

    def restore_prefix(self, ids: list[int]) -> int:
        """A replay's (engine.session.replay) reuse_prefix: ids is exactly the prefix reuse_prefix restored when the memory
        was fed, so a snapshot may end where ids end."""
        return self._reuse(ids, len(ids))

    def _reuse(self, ids: list[int], last: int) -> int:
        """Restore the longest prefix of ids the store has, a snapshot ending at most at `last`; its length."""
        if self.tokens or self.store is None or self.attachments:
            return 0
        n = self._reuse_snapshot(ids, last) or self._reuse_exact(ids)
        if n:
            self.store.flush()  # the entries' new recency must outlive this process, or LRU evicts the hot ones
        self.prefix.canonical = n  # what a cold read of the prompt holds there (engine.memory.cascade.prefix)
        self.reused_tokens = n
        return n

    def _reuse_exact(self, ids: list[int]) -> int:
        found = self.prefix.find_exact(ids)
        if not found:
            return 0
        b = self.cfg.block_size
        n = len(found) * b
        slots, _ = self.working.assign(n)
        for j, (k, v) in enumerate(found):
            self.backend.write_kv(self.row, torch.tensor(slots[j * b : (j + 1) * b]), k, v)
        self.prefix.persisted = n
        self.prefix.feed(ids[:n], 0)
        self.tokens.extend(ids[:n])
        self.pictures.feed(ids[:n], 0)
        self.retriever.since_route += n
        self.working.refresh_positions()
        return n

    def _reuse_snapshot(self, ids: list[int], last: int) -> int:
        """Restore the longest stored snapshot ending at most at `last` whose tokens are a prefix of ids; its
        length, or 0."""
        found = self.prefix.find_snapshot(ids, last, self.state_target())
        if found is None:
            return 0
        self._restore(found.meta, found.tensors)
        for bid, key in found.refs.items():  # their KV is on disk under these keys already: no need to hash it
            block = self.episodic.blocks.get(bid)
            if block is not None and block.k is not None:
                block.l3_key = key
        return found.tokens

    def snapshot_key(self, prefix: list[int]) -> str:
        """The L3 key a snapshot of this memory holding exactly `prefix` is stored under."""
        return self.prefix.snapshot_key(prefix)

    def prefill_cut(self, ids: list[int], start: int) -> list[int]:
        """Before a prompt `ids` is fed from index `start` (after reuse_prefix): indices of ids where chunks must
        end, ascending. With a store, a prompt read into an empty memory is chunked on a grid, so that reusing a
        prefix changes nothing and the memory can snapshot its state (engine.memory.cascade.prefix). When the conversation
        reaches past the window, the prompt's last tokens also go in small chunks: a forward's query summary
        routes the next one, so the question at the end of a prompt routes the tokens that answer it."""
        base = len(self.tokens) - start  # absolute index of ids[0]
        end = base + len(ids)
        cuts: set[int] = set()
        if self.cfg.retrieval_blocks and (end > self.cfg.sink_tokens + self.cfg.window or self.attachments):
            cuts.update(
                c - base
                for c in range(end - TAIL_STEP, end - TAIL_STEP * TAIL_STEPS - 1, -TAIL_STEP)
                if c > len(self.tokens)
            )
        cuts.update(c - base for c in self.prefix.cut(len(self.tokens), end, TAIL_STEP * TAIL_STEPS))
        if self.pictures.tokens is not None:
            # Each picture's end: no plan pushes out part of a picture while it feeds the rest (the module doc).
            # Whatever the prompt's length, so a prefix's chunks (and a snapshot of it) are the same in every prompt.
            cuts.update(c for c in self.pictures.ends_in(ids, base) if c + base > len(self.tokens))
        return sorted(cuts)

    def spill(self) -> int:
        """Free host memory under pressure: episodic KV goes to disk (see EpisodicMemory.spill); bytes freed."""
        return self.episodic.spill()

    def max_feed(self) -> int:
        return self.cfg.window  # one plan's tokens must fit the window together

    def slots_after(self, tokens: int) -> int:
        return self.working.slots_after(tokens)

    def speculation_room(self) -> int:
        """Only until the window is full: a verify chunk that pushed tokens out would have its early drafts see
        the window as it is after the whole chunk (see the module doc), not as one-by-one decoding sees it, and
        taking back an eviction would mean un-forming episodic blocks and un-persisting prefix blocks."""
        w = self.working
        return min(self.cfg.window, (self.cfg.sink_tokens - w.n_sink) + (self.cfg.window - w.n_window))

    def rollback(self, n: int) -> None:
        """Part of a plan that evicted nothing (speculation), or the whole of any plan before its after_forward (a
        forward stopped midway): the tokens it pushed out of the window go back into their slots."""
        self._verified = True  # even with nothing taken back: the routing query is kept token by token
        if n == 0:
            return
        whole = n == self._last_fed and self._evicted_kv is not None
        if n > self._last_fed or (self._last_evicted and not whole):
            raise ValueError(
                "rollback takes back only tokens of the last plan, and part of one only when it evicted nothing"
            )
        kept = self._last_fed - n
        start = len(self.tokens) - self._last_fed
        self.working.unassign(n, self._last_evicted - self._released, self._released)
        if self._evicted_kv is not None:
            gone, k, v = self._evicted_kv
            self.backend.write_kv(self.row, gone, k, v)  # over what the stopped forward's first layers wrote
            self._evicted_kv = None
            self._last_evicted = self._released = 0
        self.working.refresh_positions()
        self.prefix.take_back(self.tokens[start : start + kept], start)
        self.pictures.truncate(self.tokens, start + kept)
        del self.tokens[-n:]
        self.retriever.since_route -= n
        self._last_fed = kept
        self._taken_back = True

    def fork_view(self) -> ForkView:
        """Forks (beam search) see what the next token would see before the window slides for it: the sinks, the
        retrieved blocks and the whole window, with positions continuing after the window's newest. While the forks'
        tokens fit the window's free slots this is exactly what decoding them one by one sees; past that, one by one
        would push the window's oldest tokens out as each fork grows, which forks sharing one window cannot do, so
        they keep seeing them (documented in engine.generation.beam)."""
        w = self.working
        position = (
            w.n_sink
            if w.n_sink < self.cfg.sink_tokens
            else self.cfg.sink_tokens + w.resident_blocks * w.block + w.n_window
        )
        table = self.backend.config.max_position_embeddings + ROTARY_HEADROOM
        return ForkView(
            position,
            len(self.tokens),
            w.slot_positions.clone(),
            w.valid.clone(),
            w.slot_tokens(),
            max_depth=table - position - w.frame,
            frame=w.frame,
            frame_start=w.window_start,
        )

    def stats(self) -> CascadeStats:
        persistent = self.store.stats() if self.store is not None else TierStats.make("persistent", 0, 0, 0, 0, 0, 0)
        return CascadeStats(self.working.stats(self.kv_token_bytes), self.episodic.stats(), persistent)

    # -- session state ------------------------------------------------------------------------------------------

    def state(self, paged: dict[int, PagedBlocks] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Meta (JSON-able) + tensors: working slots' KV (L, Hkv, S, D) fp16, episodic blocks fp16 with their key
        bounds, and the routing state (engine.memory.cascade.retrieval). Every tensor is the state's own (a copy, or
        a block's KV, which never changes once formed). `paged`: see EpisodicMemory.state."""
        ep_meta, tensors = self.episodic.state(paged)
        k, v = self.backend.read_kv(self.row, torch.arange(self.cfg.num_slots))  # (L, Hkv, S, D) each
        tensors.update({"wk.k": k, "wk.v": v})
        routing, route_tensors = self.retriever.state()
        tensors.update(route_tensors)
        meta = {
            "kind": "cascade",
            "version": STATE_VERSION,
            "config": self.cfg.to_dict(),
            "tokens": list(self.tokens),
            "working": self.working.state(),
            "episodic": ep_meta,
            "routing": routing,
            "prefix": self.prefix.state(),
            "counters": self.working.counters.to_dict(),
        }
        pictures = self.pictures.state()
        if pictures is not None:  # only where there are any: a text conversation's state is as it always was
            meta["pictures"] = pictures
        return meta, tensors

    def state_target(self) -> StateTarget:
        c = self.backend.config
        dims = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        return StateTarget(c.id_limit, dims, cascade=self.cfg, max_positions=c.max_position_embeddings)

    def load_state(
        self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], paged: PagedBlocks | None = None
    ) -> None:
        """Restore a state saved by any memory of the same model and numerics: in its own geometry (within the
        model's trained context) under this memory's budgets (engine.memory.cascade.config.CascadeConfig.state_settings).
        `paged`: where the episodic blocks given as shapes only ("meta" tensors, checked as shapes here) are read
        from when first needed, each checked then (engine.session.kept)."""
        try:  # the one schema (engine.memory.cascade.state_schema): nothing is touched unless all of it holds
            check_cascade_state(meta, tensors, self.state_target())
        except SchemaError as exc:
            raise SessionFileError(f"The saved memory cannot be restored: it {exc}.") from None
        if meta.get("version") == 1:
            meta, tensors = migrate_state(meta, tensors)
        saved = CascadeConfig.from_dict(meta["config"])
        if not saved.same_state(self.cfg):
            if self.backend.batch != 1 or self.row != 0:
                raise SessionFileError(
                    "The saved memory used a different cascade geometry; restore it with the same settings."
                )
            self._layout(saved.with_budgets_of(self.cfg))
        self._restore(meta, tensors, paged)
        self.prefix.canonical = None  # a conversation, however it was fed: never snapshot as a fresh read

    def _restore(
        self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], paged: PagedBlocks | None = None
    ) -> None:
        """load_state without its checks (callers check the kind, version and settings)."""
        self._reset_state()
        self.backend.write_kv(self.row, torch.arange(self.cfg.num_slots), tensors["wk.k"], tensors["wk.v"])
        self.working.load_state(meta["working"])
        self.working.counters = Counters.from_dict(meta["counters"])
        self.episodic.load_state(meta["episodic"], tensors, paged)
        self.retriever.load_state(meta["routing"], tensors)
        tokens = [int(t) for t in meta["tokens"]]
        self.prefix.load_state(meta["prefix"], tokens)
        self.pictures.load_state(meta.get("pictures"), tokens)
        self.tokens = tokens
