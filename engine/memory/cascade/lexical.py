"""A lexical index over attached blocks: which blocks share the conversation's rarest words (BM25 over token ids).

Quest key bounds rank a block by the best dot product any of its keys could give the question's queries; among a
dozen passages that read alike (the same template, other names and numbers) every one of them bounds about as
high, and the one the question names is not reliably first (docs/BENCHMARKS.md, "Documents as memory"). The words
the question shares with a passage separate them at once: a block that holds the question's rare terms is the
passage it asks about. So while documents are attached, each routing decision also scores the attached blocks
against the conversation's most recent tokens with BM25 (the field's standard lexical ranking; hybrid lexical +
dense retrieval is standard practice), and the few blocks it ranks clearly first, each with its neighbours, are every
layer's retrieval groups (engine.memory.cascade.retrieval); the bounds route when the question names no block.

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
    _cache: tuple[frozenset[int], torch.Tensor] | None = None

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
        self._cache = None

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
        self._cache = None

    def scores(self, query: list[int]) -> torch.Tensor:
        """(rows,) float32: each block's BM25 score for the distinct terms of `query` (a term counts once, so a
        question repeating a word, or a prompt repeating boilerplate, does not outweigh a rare word)."""
        terms = frozenset(t for t in query if t in self.postings)
        if self._cache is not None and self._cache[0] == terms:
            return self._cache[1]
        n = len(self.ids)
        out = torch.zeros(n, dtype=torch.float64)
        for term in sorted(terms):  # sorted: the same sum in the same order on every run
            rows, counts = zip(*self.postings[term], strict=True)
            df = len(rows)
            idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
            tf = torch.tensor(counts, dtype=torch.float64)
            out.index_add_(0, torch.tensor(rows), idf * tf * (K1 + 1) / (tf + K1))
        result = out.float()
        self._cache = (terms, result)
        return result

    def top(self, query: list[int], limit: int, ratio: float, least: float = 0.0) -> list[int]:
        """Block ids of at most `limit` blocks, best first, scoring at least `ratio` of the best score, when the
        best reaches `least` (and is above 0): the blocks the query names clearly, rather than a fixed number
        whatever their score. Ties go to the older block."""
        if not self.ids or limit <= 0:
            return []
        s = self.scores(query)
        best = float(s.max())
        if best <= 0.0 or best < least:
            return []
        rows = (s >= ratio * best).nonzero().flatten().tolist()
        return [self.ids[r] for r in sorted(rows, key=lambda r: (-float(s[r]), self.ids[r]))[:limit]]

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
