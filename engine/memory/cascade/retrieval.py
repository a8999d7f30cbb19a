"""Retrieval: which episodic blocks each layer's retrieval groups hold, and paging them into the slot table.

The routing query is the backend's query summary (per layer and KV head, the mean pre-RoPE query of the last
forwards, over their last `proxy_tokens` tokens; a backend without one: the mean key of the most recent tokens).
When the routing strategy (engine.memory.cascade.routing) says so (a new prompt chunk, drift, the clock), each layer
ranks its top-k episodic blocks, as many as the retrieval gate admits (engine.memory.cascade.window_bounds). While a
prompt is read, each layer's groups hold its own picks; while answering (a decoding step, or a prompt's last
tokens, which route the reply) the blocks the layers rank highest together fill the first groups in every layer
and each layer's best others its last `layer_blocks` groups (consensus_groups).
Only the (layer, group) pairs whose block changed are paged in (read from host memory, or back from L3).
While documents are attached (pinned blocks), the recent summaries are kept per token where the backend gives them,
blocks rank by their best bound over those tokens' queries, and the consensus votes over each layer's top
ATTACHED_DEPTH. When the conversation's recent tokens name attached passages (engine.memory.cascade.lexical's BM25
over each block with the PASSAGE_RADIUS blocks either side: at most LEXICAL_BLOCKS, each within LEXICAL_RATIO of the
best and holding a rare word of the question the best lacks, the best at least LEXICAL_LEAST), those passages are
every layer's groups instead, and only they: the look-alike
blocks the bounds rank as high would otherwise sit beside them, and the model answers from one of those
(docs/BENCHMARKS.md, "Documents as memory").
A picture is recalled whole: when any layer picks one of its blocks, all of the picture's blocks fill the first
groups of every layer (as the passages a question names do, after them), in conversation order, as many pictures
as the groups hold whole, in the order the layers rank them (engine.memory.cascade.pictures); the groups they leave
hold text routing's picks as without them, as many as it chose (beside named passages: none). A vision model's
geometry has groups for its largest picture (CascadeConfig.fit_to); a picture of more blocks than there are groups
(a context too short for that room) cannot come back whole: its blocks are routed one by one, as text's are.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

from engine.backends.base import Backend
from engine.memory.cascade.config import CascadeConfig
from engine.memory.cascade.episodic import EpisodicMemory
from engine.memory.cascade.lexical import QUERY_TOKENS, LexicalIndex
from engine.memory.cascade.pictures import PictureSpans
from engine.memory.cascade.routing import ROUTING, RouteContext
from engine.memory.cascade.window_bounds import WindowBounds
from engine.memory.cascade.working import WorkingMemory


def consensus_groups(chosen: list[list[int]], shared: int, n: int = 0, named: tuple[int, ...] = ()) -> list[list[int]]:
    """Per layer, its n chosen blocks (best first) -> the blocks its n retrieval groups hold, in group order.

    Groups [0, shared) hold, in every layer alike, the `shared` blocks the layers rank highest together (Borda
    count over the layers' rankings; ties to the older block); groups [shared, n) hold each layer's best other
    blocks. Each part is in conversation order. `named` (at most n blocks: those the question names,
    engine.memory.cascade.lexical) are shared by every layer first, whatever the layers rank, and the vote fills
    the shared groups they leave. Why: one position table serves every layer, so a block's position
    follows its group; when layers put the same block in different groups, its tokens sit at positions up to
    n * block_size apart from one layer to the next, and on the default model a passkey retrieved by every layer
    was still misread (bench passkey); blocks in conversation order read a fact split over blocks j, j + 1 whole.
    """
    depth = len(chosen[0]) if chosen else 0
    n = n or depth  # `chosen` may rank deeper than the n groups (attachments: ATTACHED_DEPTH), every block voting
    votes: dict[int, int] = {}
    for pick in chosen:
        for rank, b in enumerate(pick):
            votes[b] = votes.get(b, 0) + depth - rank
    named = named[:n]
    voted = [b for b in sorted(votes, key=lambda b: (-votes[b], b)) if b not in named]
    common = sorted([*named, *voted[: max(0, shared - len(named))]])
    return [common + sorted([b for b in pick if b not in common][: n - len(common)]) for pick in chosen]


ATTACHED_DEPTH = 32  # with attachments, how deep each layer's ranking votes in the consensus
LEXICAL_BLOCKS = 4  # with attachments, at most this many blocks the question names go into every layer's groups
# ... each scoring at least this share of the best passage's score, and holding a rare word of the question the best
# lacks: near-ties only, since a passage sharing part of the question's words (another fact in the same words) is
# a look-alike, and the model copies look-alikes it sees
LEXICAL_RATIO = 0.8
# ... and only when the best scores this much: about one word that one block in 20 holds (BM25's idf of such a
# word is ln(1 + 19.5 / 1.5) = 2.6), so words most blocks share never name a passage on their own.
LEXICAL_LEAST = 2.5
PASSAGE_RADIUS = 1  # a block is scored, and read, with this many blocks either side (a sentence cut by an edge)


class Retriever:
    """Routing state and paging for one memory (row `row` of the backend's slot table)."""

    def __init__(
        self,
        backend: Backend,
        row: int,
        cfg: CascadeConfig,
        working: WorkingMemory,
        episodic: EpisodicMemory,
        lexical: LexicalIndex | None = None,
        pictures: PictureSpans | None = None,
    ) -> None:
        """`lexical`: the attached blocks' index (the memory's, as it outlives a reset like the attachments);
        `pictures`: where the conversation's pictures lie (the memory's)."""
        self.backend = backend
        self.lexical = lexical if lexical is not None else LexicalIndex()
        self.pictures = pictures if pictures is not None else PictureSpans()
        self.row = row
        self.cfg = cfg
        self.working = working
        self.episodic = episodic
        self.strategy = ROUTING[cfg.routing]()
        self.window_bounds = WindowBounds(backend, row, working, episodic.kv_shape)
        self.reset()

    def reset(self) -> None:
        self.since_route = 0  # tokens fed since the last routing decision
        self.recent: list[tuple[torch.Tensor, int]] = []  # (query summary (L, Hkv, D) fp32, tokens) of recent forwards
        self.routed: torch.Tensor | None = None  # (L, Hkv, D) the routing query of the last routing decision
        self.window_bounds.reset()

    # -- the routing query --------------------------------------------------------------------------------------

    def _recent_keys(self, n: int) -> torch.Tensor | None:
        """For backends without a query summary: the mean key of the n most recent tokens, (L, Hkv, D)."""
        slots = self.working.recent_slots(n)
        if slots.numel() == 0:
            return None
        k, _ = self.backend.read_kv(self.row, slots)  # (L, Hkv, m, D)
        return k.float().mean(dim=2)

    def _routing_query(self) -> torch.Tensor | None:
        """(L, Hkv, D): the query summaries of the last proxy_tokens tokens, weighted by their forwards' tokens."""
        if not self.recent:
            return self._recent_keys(self.cfg.proxy_tokens)
        total = sum(n for _, n in self.recent)
        return functools.reduce(operator.add, (q * (n / total) for q, n in self.recent))

    def remember_summary(self, tokens: int) -> None:
        """After a forward of `tokens` tokens: keep its query summary for the next routing query."""
        if self.episodic.pinned:  # attachments route by each recent token's query (route): keep them one by one
            per_token = self.backend.token_summaries()  # (T, L, Hkv, D) or None
            if per_token is not None and per_token.shape[0] == tokens:
                for t in range(tokens):
                    self._keep(per_token[t].float().clone(), 1)
                return
        summary = self.backend.query_summary()  # (B, L, Hkv, D) or None
        if summary is None:
            return
        self._keep(summary[self.row].float().clone(), tokens)

    def remember_tokens(self, kept: int, whole: bool) -> None:
        """After a speculative verify whose first `kept` tokens stay (`whole`: all of them): keep their summaries
        one by one, as decoding them step by step would have, so routing never depends on how a reply was
        drafted. A backend without per-token summaries: the forward's summary, only when it covers exactly the
        kept tokens."""
        per_token = self.backend.token_summaries()  # (T, L, Hkv, D) or None
        if per_token is None or per_token.shape[0] < kept:
            if whole:
                self.remember_summary(kept)
            return
        for t in range(kept):
            self._keep(per_token[t].float().clone(), 1)

    def _keep(self, summary: torch.Tensor, tokens: int) -> None:
        """summary (L, Hkv, D) of a forward of `tokens` tokens: the newest of the recent ones (proxy_tokens)."""
        self.recent.append((summary, tokens))
        while len(self.recent) > 1 and sum(n for _, n in self.recent[1:]) >= self.cfg.proxy_tokens:
            self.recent.pop(0)

    def _drift(self, query: torch.Tensor) -> float:
        if self.routed is None:
            return 1.0
        return 1.0 - float(torch.nn.functional.cosine_similarity(query, self.routed, dim=-1).mean())

    # -- routing and paging -------------------------------------------------------------------------------------

    def route(self, prefill: bool, answering: bool, fed: list[int] | None = None) -> None:
        """Before a plan: re-select and page in each layer's blocks when the strategy says so. `answering`: the
        plan is a decoding step or a prompt's last tokens (they route the reply), else part of a prompt being read.
        `fed`: the token ids fed so far (their last QUERY_TOKENS are the lexical query while anything is attached;
        only tokens already fed, as the query summaries are, so a reply never depends on how it was drafted)."""
        query = self._routing_query()
        if query is None:
            return
        ctx = RouteContext(
            prefill, self.since_route, self.cfg.reroute_every, self._drift(query), self.cfg.reroute_drift / 100
        )
        if not self.strategy.should_route(ctx):
            return
        self.since_route = 0
        self.routed = query
        beat = self.window_bounds.threshold(query, self.cfg.gate_rank)  # (L,) or None: the retrieval gate
        # A decoding step never empties a group: a step that changes how many are filled re-rotates the whole
        # window's read copies (engine.model.slots), so within a reply the gate may only add groups.
        keep = 0 if prefill else self.working.resident_blocks
        if self.episodic.pinned:  # attached documents are there to be consulted: the gate never shuts them out
            keep = self.cfg.retrieval_blocks
        # With attachments, blocks rank by their best score over the recent tokens' own queries and the layers
        # vote over their top ATTACHED_DEPTH (bench documents): the mean query and each layer's top few could not
        # tell look-alike facts apart.
        tokens = torch.stack([q for q, _ in self.recent]) if self.episodic.pinned and self.recent else None
        depth = ATTACHED_DEPTH if self.episodic.pinned else 0
        while True:
            chosen = self.episodic.select(query, self.cfg.retrieval_blocks, beat, keep, tokens, depth)  # (L, >= n)
            n = min(len(chosen[0]), self.cfg.retrieval_blocks)
            shared = n - min(n, self.cfg.layer_blocks) if answering else 0
            named = self._named(fed, n)
            if named:  # the passages the question names, and only those, in every layer
                # (while decoding, never fewer groups than are filled: the vote fills what they leave)
                n = len(named) if prefill else max(len(named), min(n, self.working.resident_blocks))
                shared = n
            whole = self._whole_pictures(chosen, n, named)
            if named:  # the passages and the pictures among them, and only they
                n = max(n, len(whole))
            elif whole:  # pictures first, whole; text routing keeps as many groups beside them as it chose
                text = min([n, *(len([b for b in pick if b not in whole]) for pick in chosen)])
                n = min(self.cfg.retrieval_blocks, len(whole) + text)
                shared = min(n, len(whole) + shared)
            if self._page_in(consensus_groups(chosen, shared, n, whole)):
                return

    def _whole_pictures(self, chosen: list[list[int]], n: int, named: tuple[int, ...]) -> tuple[int, ...]:
        """`named`, then every block of each picture one of whose blocks a layer put among its first n picks, the
        best-ranked picks first, while they fit the retrieval groups whole."""
        if not self.pictures.spans or not n:
            return named
        of: dict[int, tuple[int, ...]] = {}  # block id -> its picture's blocks still held
        for span in self.pictures.blocks(self.cfg.sink_tokens, self.cfg.block_size):
            held = tuple(b for b in span if b in self.episodic.blocks)
            of.update(dict.fromkeys(held, held))
        out = list(named)
        for rank in range(n):
            for pick in chosen:
                blocks = of.get(pick[rank], ()) if rank < len(pick) else ()
                extra = [b for b in blocks if b not in out]
                if extra and len(out) + len(extra) <= self.cfg.retrieval_blocks:
                    out += extra
        return tuple(out)

    def _named(self, fed: list[int] | None, n: int) -> tuple[int, ...]:
        """Up to n attached blocks: the middle blocks of the passages the recent tokens name (BM25;
        engine.memory.cascade.lexical), best first, then the PASSAGE_RADIUS blocks either side of each; () when
        they name none."""
        if not fed or not n or not self.episodic.pinned or not len(self.lexical):
            return ()
        picks = self.lexical.top(fed[-QUERY_TOKENS:], LEXICAL_BLOCKS, LEXICAL_RATIO, LEXICAL_LEAST, PASSAGE_RADIUS)
        picks = [b for b in picks if b in self.episodic.blocks]
        around = self.lexical.passage(picks, min(n, (2 * PASSAGE_RADIUS + 1) * len(picks)))
        return tuple(b for b in around if b in self.episodic.blocks)

    def _page_in(self, new: list[list[int]]) -> bool:
        """Put each layer's blocks in its retrieval groups (new[layer][g]: group g's block), paging in only
        (layer, group) pairs that change.
        False when a block turned out to be gone (forgotten from L3): the caller selects again."""
        old = self.working.groups
        n = len(new[0])
        changed = {
            (layer, g)
            for layer in range(len(new))
            for g in range(n)
            if g >= len(old[layer]) or old[layer][g] != new[layer][g]
        }
        needed = {new[layer][g] for layer, g in changed}
        protect = tuple({b for pick in new for b in pick})
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for bid in sorted(needed):
            got = self.episodic.fetch(bid, protect=protect)
            if got is None:
                return False
            kv[bid] = got
        for bid in set(protect) - needed:
            self.episodic.touch(bid)
        self.working.counters.hits += n * len(new) - len(changed)
        self.working.counters.misses += len(changed)
        for g in sorted({g for _, g in changed}):
            slots = self.working.group_slots(g)
            k, v = self.backend.read_kv(self.row, slots)  # (L, Hkv, B, D): layers that keep their block keep their KV
            ks, vs = list(k.unbind(0)), list(v.unbind(0))
            for layer in (layer for layer, gg in changed if gg == g):
                bk, bv = kv[new[layer][g]]
                ks[layer], vs[layer] = bk[layer], bv[layer]
            self.backend.write_kv(self.row, slots, torch.stack(ks), torch.stack(vs))
        self.working.set_groups(new)
        return True

    # -- state --------------------------------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The routing meta and tensors, fp32 as computed (so a restored conversation routes exactly as an
        uninterrupted one): route.recent (n, L, Hkv*D) query summaries, route.routed (L, Hkv, D)."""
        tensors: dict[str, torch.Tensor] = {}
        if self.recent:
            # (n, L, Hkv*D): three dimensions, so no reader mistakes it for KV in the canonical (L, Hkv, n, D) layout
            tensors["route.recent"] = torch.stack([q.flatten(1) for q, _ in self.recent])
        if self.routed is not None:
            tensors["route.routed"] = self.routed.clone()
        return {"since_route": self.since_route, "recent_tokens": [n for _, n in self.recent]}, tensors

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.reset()
        self.since_route = int(meta["since_route"])
        recent = tensors.get("route.recent")
        counts = [int(n) for n in meta["recent_tokens"]]
        shape = self.episodic.kv_shape
        self.recent = (
            []
            if recent is None
            else [(recent[i].float().reshape(shape).clone(), counts[i]) for i in range(len(counts))]
        )
        routed = tensors.get("route.routed")
        self.routed = None if routed is None else routed.float().clone()
