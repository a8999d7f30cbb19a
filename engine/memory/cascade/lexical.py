"""A lexical index over attached blocks: which blocks share the conversation's rarest words (BM25 over token ids).

Quest key bounds rank a block by the best dot product any of its keys could give the question's queries; among a
dozen passages that read alike (the same template, other names and numbers) every one of them bounds about as
high, and the one the question names is not reliably first (docs/BENCHMARKS.md, "Documents as memory"). The words
the question shares with a passage separate them at once: a block that holds the question's rare terms is the
passage it asks about. So while documents are attached, each routing decision also scores the attached passages
(a block with its neighbours, so a sentence cut by a block's edge scores whole) against the conversation's most
recent tokens with BM25 (the field's standard lexical ranking; hybrid lexical + dense retrieval is standard
practice), and the few passages it ranks clearly first, none overlapping another, are every layer's retrieval groups
(engine.memory.cascade.retrieval); the bounds route when the question names no block.

Terms are token ids: the index needs no tokenizer and no language, and a term is exactly what the model read. It
is built from the blocks' own token ids (an attached capsule's ids, engine.documents.capsule), so it cannot
disagree with them and adds nothing to the store. Its size is bounded by the tokens attached (one posting per
distinct token of a block). Document frequencies count blocks over everything attached to this memory, so a word
every passage holds (the template, the filler) weighs next to nothing and a word one passage holds weighs most.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

K1 = 1.2  # BM25's term-frequency saturation (the usual value); blocks are all one size, so its b does not apply
QUERY_TOKENS = 256  # the recent tokens a routing decision's query is made of (the question, and what led to it)
MAX_TERM_ID = 1 << 31  # token ids are vocabulary rows: anything else is not a token
MAX_BLOCKS = 1 << 20  # at most what MAX_ATTACHMENTS capsules of MAX_CAPSULE_TOKENS each hold in 32-token blocks


@dataclass
class LexicalIndex:
    """Per attached block, the counts of its token ids; scores blocks against a query's tokens (BM25)."""

    ids: list[int] = field(default_factory=list)  # block id of row r
    spans: list[tuple[int, int]] = field(default_factory=list)  # (first, end) block ids of each text added
    postings: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # term -> (row, count) per block
    _cache: tuple[frozenset[int], int, torch.Tensor] | None = None
    _bounds: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, first_id: int, tokens: list[int], block_size: int) -> None:
        """Blocks first_id, first_id + 1, ... holding `tokens` (whole blocks of `block_size`) join the index.
        ValueError for anything that is not whole blocks of token ids."""
        if block_size <= 0 or len(tokens) % block_size:
            raise ValueError(f"{len(tokens)} tokens are not whole blocks of {block_size}")
        n = len(tokens) // block_size
        if len(self.ids) + n > MAX_BLOCKS:
            raise ValueError(f"the lexical index holds at most {MAX_BLOCKS:,} blocks")
        if any(not isinstance(t, int) or not 0 <= t < MAX_TERM_ID for t in tokens):
            raise ValueError("a token id is out of range")
        self.spans.append((first_id, first_id + n))
        for j in range(n):
            row = len(self.ids)
            self.ids.append(first_id + j)
            for term, count in Counter(tokens[j * block_size : (j + 1) * block_size]).items():
                self.postings.setdefault(term, []).append((row, count))
        self._cache = self._bounds = None

    def remove(self, first_id: int) -> None:
        """The text added at `first_id` leaves (a detached attachment): its blocks are never named again, and the
        document frequencies count only what stays."""
        span = next(((f, e) for f, e in self.spans if f == first_id), None)
        if span is None:
            return
        keep = [r for r, b in enumerate(self.ids) if not span[0] <= b < span[1]]
        row_of = {r: i for i, r in enumerate(keep)}
        self.ids = [self.ids[r] for r in keep]
        self.spans.remove(span)
        postings = {}
        for term, rows in self.postings.items():
            kept = [(row_of[r], c) for r, c in rows if r in row_of]
            if kept:
                postings[term] = kept
        self.postings = postings
        self._cache = self._bounds = None

    def _row_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows,) long each: the first row of each row's text and the row past its last (a text's rows are
        contiguous, in block order)."""
        if self._bounds is None:
            lo, hi = [0] * len(self.ids), [0] * len(self.ids)
            start = 0
            for first, end in self.spans:  # a text's blocks are added, and kept, together and in span order
                n = end - first
                lo[start : start + n], hi[start : start + n] = [start] * n, [start + n] * n
                start += n
            self._bounds = (torch.tensor(lo, dtype=torch.long), torch.tensor(hi, dtype=torch.long))
        return self._bounds

    def _window_rows(self, term: int, radius: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows whose window (the row and `radius` rows either side in its own text) holds `term`, and how
        often it does there."""
        rows, counts = zip(*self.postings[term], strict=True)
        r, c = torch.tensor(rows, dtype=torch.long), torch.tensor(counts, dtype=torch.float64)
        if not radius:
            return r, c
        lo, hi = self._row_bounds()
        ws, cs = [], []
        for d in range(-radius, radius + 1):
            w = r + d
            inside = (w >= lo[r]) & (w < hi[r])
            ws.append(w[inside])
            cs.append(c[inside])
        rows_t, inverse = torch.unique(torch.cat(ws), return_inverse=True)
        return rows_t, torch.zeros(len(rows_t), dtype=torch.float64).index_add_(0, inverse, torch.cat(cs))

    def _idf(self, term: int) -> float:
        n, df = len(self.ids), len(self.postings[term])
        return math.log(1.0 + (n - df + 0.5) / (df + 0.5))

    def scores(self, query: list[int], radius: int = 0) -> torch.Tensor:
        """(rows,) float32: each block's BM25 score for the distinct terms of `query` (a term counts once, so a
        question repeating a word, or a prompt repeating boilerplate, does not outweigh a rare word), its terms
        counted over its window: the block and `radius` blocks either side in its own text (a passage: a fact cut
        by a block's edge scores whole in the windows holding both halves)."""
        terms = frozenset(t for t in query if t in self.postings)
        if self._cache is not None and self._cache[:2] == (terms, radius):
            return self._cache[2]
        out = torch.zeros(len(self.ids), dtype=torch.float64)
        for term in sorted(terms):  # sorted: the same sum in the same order on every run
            rows, tf = self._window_rows(term, radius)
            out.index_add_(0, rows, self._idf(term) * tf * (K1 + 1) / (tf + K1))
        result = out.float()
        self._cache = (terms, radius, result)
        return result

    def top(self, query: list[int], limit: int, ratio: float, least: float = 0.0, radius: int = 0) -> list[int]:
        """Block ids of at most `limit` windows (scores(query, radius)), best first, each window's own best block
        (scores(query): the part of the passage that holds most of it; the first of equals), when the best
        reaches `least` (and is above 0): the passages the query names clearly, rather than a fixed number
        whatever their score. Ties go to the older block. Beside the best, a window counts only when it
        - scores at least `ratio` of the best,
        - holds rare query terms (idf >= `least`: each could name a passage alone) that the best does not: one
          holding only some of the best's (one of the question's two names) is a partial match, not a tie, and
        - overlaps no window already named (adjacent windows share blocks and score alike: one passage, once)."""
        if not self.ids or limit <= 0:
            return []
        s = self.scores(query, radius)
        best = float(s.max())
        if best <= 0.0 or best < least:
            return []
        rows = sorted((s >= ratio * best).nonzero().flatten().tolist(), key=lambda r: (-float(s[r]), self.ids[r]))
        lo, _ = self._row_bounds()
        rare = [t for t in sorted(frozenset(query) & self.postings.keys()) if self._idf(t) >= least]
        holders = {t: set(self._window_rows(t, radius)[0].tolist()) for t in rare}

        def matched(r: int) -> frozenset[int]:
            return frozenset(t for t in rare if r in holders[t])

        first = matched(rows[0])
        named = [rows[0]]
        for r in rows[1:]:
            if len(named) >= limit:
                break
            if matched(r) < first:
                continue
            if any(lo[r] == lo[c] and abs(r - c) <= 2 * radius for c in named):
                continue
            named.append(r)
        if radius:  # each passage read around its own best block, the one holding most of it (not a window's edge)
            own = self.scores(query)
            lo, hi = self._row_bounds()
            named = [
                max(range(max(r - radius, int(lo[r])), min(r + radius + 1, int(hi[r]))), key=lambda c: float(own[c]))
                for r in named
            ]
        return [self.ids[r] for r in dict.fromkeys(named)]

    def passage(self, named: list[int], n: int) -> list[int]:
        """Up to n block ids: `named` first, then the blocks around them in their own text, nearest first (a
        named block is read with what precedes and follows it, as a reader would read the passage)."""
        out = list(dict.fromkeys(named))[:n]
        around: list[tuple[int, int, int]] = []  # (distance, rank of the named block, block id)
        for rank, b in enumerate(out):
            first, end = next(((f, e) for f, e in self.spans if f <= b < e), (b, b + 1))
            for d in range(1, n):
                around += [(d, rank, c) for c in (b - d, b + d) if first <= c < end]
        for _, _, c in sorted(around):
            if len(out) >= n:
                break
            if c not in out:
                out.append(c)
        return out
