"""Speculative decoding's parts: drafters that propose the next tokens, and the controller that decides how many to
verify per forward (engine.generation.loop runs the verify forward and commits what it accepts).

A drafter proposes up to K tokens after the context; one forward over [last token, drafts] (a K+1-token chunk, on
the prefill kernels) gives the target's logits at every position; the sampler's rule (engine.generation.sampling
`Sampler.verify`) keeps a prefix of the drafts and adds one token of its own, so a forward yields 1 to K+1 tokens
where plain decoding yields one, and the memory takes back the rejected drafts (engine.memory.base `rollback`).

Drafters:
  - `PromptLookup`: the continuation of the latest earlier occurrence of the context's last n-gram (longest n
    first) in everything the memory was fed and the reply so far: the prompt, earlier turns, and passages the
    conversation recalled or pasted. Free to run, and right exactly where a reply copies (code edits, quotes).
  - `DraftModel`: a smaller model with the same tokenizer, on its own slot table and full-attention memory.

Adaptive K (`Controller`): it measures the cost of a decode step and of a verify forward of each width, and the
rate at which drafts are accepted, and picks the K that maximizes expected tokens per second — K = 0 (plain
decoding) wherever no K beats a decode step. Costs are kept per width, not as a slope: on the CPU a verify of up to
16 tokens is one native call (engine.backends.native, spark_decode_rows) whose matrix products take the kernels' row
route below 8 tokens (each token costing nearly a decode step's product) and their token-lane route from 8 (16 lanes
at a time on AVX-512), so cost is not linear in the width: on the default model at one thread a verify of 2, 4, 8,
12, 16 tokens cost 1.5, 2.4, 3.6, 4.0, 4.4 decode steps. With a drafter that proposes nothing (no n-gram match) the
step is a plain decode step, so prompt lookup costs nothing where it does not apply: `auto` speculates by lookup
for greedy replies where the backend's verifies are measured to pay (`resolve`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol

import torch

from engine.backends.base import Backend
from engine.generation.sampling import Sampler, SamplingSettings
from engine.memory.base import FullAttentionMemory
from engine.model.slots import TOKEN_SUMMARY_STEP

MAX_DRAFT = TOKEN_SUMMARY_STEP - 1  # drafts per verify: a chunk of 1 + K tokens keeps per-token query summaries
LOOKUP_NGRAMS = (4, 3, 2)  # n-gram sizes prompt lookup matches, longest first
LOOKUP_KEEP = 4  # latest occurrences kept per n-gram: an earlier one may have a longer continuation
EMA = 0.15  # weight of the newest measurement in the controller's running figures
PRIOR_EXTRA = 0.25  # until measured, a drafted token is assumed to add this share of a decode step to a verify
RUN_PRIOR = 0.9  # until measured, the acceptance of drafts right after a verify that kept every draft (see Controller)
PROBE_EVERY = 16  # after this many chances passed up at K = 0, try K = 1 once (acceptance may have changed)
# An unmeasured width's further tokens are guessed at this share of what they cost in the widest measured verify:
# a guess that errs low costs one verify (which measures the width), one that errs high keeps the width from ever
# being tried, and a verify's cost per token falls the wider it is (its weights are read once).
OPTIMISM = 0.5
DRAFT_SLOTS = 4096  # the draft model's own full-attention slot table
DRAFT_CHUNK = 256  # the draft model reads the context in chunks of this many tokens


class Speculation(StrEnum):
    AUTO = "auto"  # prompt lookup, adaptive, for greedy replies where verifying pays (`resolve`); else plain decoding
    OFF = "off"
    LOOKUP = "lookup"  # prompt lookup, adaptive
    DRAFT = "draft"  # a draft model (engine.generation.speculative.DraftModel), adaptive


def resolve(mode: Speculation, backend: Backend, sampling: SamplingSettings) -> Speculation:
    """What `mode` runs as on `backend`: `auto` is prompt lookup for greedy replies on a backend whose verifies are
    measured to pay (Backend.verify_pays), plain decoding otherwise; the other modes run as named.

    The controller backs off to plain decoding where verifies lose, but it learns so by verifying: where a verify
    cost 1.6-1.8 decode steps for 2 tokens (the AVX2 kernels), greedy open chat gained nothing to count on. Sampled
    replies at the default model's own settings (temperature 0.2, a repetition penalty) accept few lookup drafts
    (a quarter to a half: the penalty steers a reply away from copying), and gained nothing either: open chat
    0.90-0.98x, code editing 0.95-1.03x (bench speculative's `sampled_tasks`)."""
    if mode is not Speculation.AUTO:
        return mode
    return Speculation.LOOKUP if backend.verify_pays and sampling.is_greedy else Speculation.OFF


class Draft(NamedTuple):
    tokens: list[int]  # proposed continuation, K <= MAX_DRAFT ids
    probs: torch.Tensor | None  # (K, V) the drafter's distribution at each token, or None: each proposed for sure


class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to `k` tokens likely to follow `context` (every token so far, the last sampled one included)."""
        ...


class PromptLookup:
    """Drafts by n-gram lookup in the context itself (llama.cpp's lookup decoding, mlx-lm's prompt lookup).

    An index maps each n-gram to the positions after its latest few occurrences; it grows with the context (which
    only ever extends between calls), so a step costs O(new tokens), not O(context). The draft continues the latest
    occurrence of the longest n-gram that matches, or an earlier one where the latest's continuation is cut short
    by the end of the context (a phrase the reply repeated a few tokens ago, while it copies a passage that goes on
    further back)."""

    def __init__(self, ngrams: Sequence[int] = LOOKUP_NGRAMS) -> None:
        self.ngrams = tuple(sorted(ngrams, reverse=True))
        self.index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its latest LOOKUP_KEEP ends, oldest first
        self.seen: list[int] = []  # the context indexed so far
        self.next_end = 0  # n-grams ending before this position (with a token after them) are indexed

    def _extend(self, context: Sequence[int]) -> None:
        n = len(self.seen)
        if len(context) < n or (n and context[n - 1] != self.seen[-1]):
            self.index, self.seen, self.next_end = {}, [], 0  # another context: start over
        self.seen.extend(context[len(self.seen) :])
        ctx = self.seen
        for end in range(self.next_end, len(ctx)):  # an n-gram ctx[end-n:end] followed by ctx[end]
            for n in self.ngrams:
                if end >= n:
                    ends = self.index.setdefault(tuple(ctx[end - n : end]), [])
                    ends.append(end)
                    del ends[:-LOOKUP_KEEP]
        self.next_end = len(ctx)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return Draft([], None)
        self._extend(context)
        ctx = self.seen
        for n in self.ngrams:
            if len(ctx) < n:
                continue
            ends = self.index.get(tuple(ctx[-n:]))
            if ends:
                # the latest whose continuation is k tokens long, else the longest (max keeps the first: the latest)
                at = max(reversed(ends), key=lambda e: min(len(ctx) - e, k))
                return Draft(list(ctx[at : at + k]), None)
        return Draft([], None)


class DraftModel:
    """Drafts with a smaller model of the same tokenizer on its own backend (its own slot table) and memory.

    Its memory follows the context: what it holds beyond the common prefix is taken back, the rest is read. Drafts
    are drawn with the target's sampling settings (greedy stays greedy) from a generator of their own, and their
    distributions go with them for the rejection rule."""

    def __init__(self, backend: Backend, sampling: SamplingSettings, slots: int = DRAFT_SLOTS) -> None:
        self.backend = backend
        if backend.num_slots != slots:
            backend.allocate(1, slots)
        self.memory = FullAttentionMemory(backend)
        # Its own stream of draws, seeded from the target's seed when there is one (reproducible runs).
        seed = None if sampling.seed is None else (sampling.seed + 1) % 2**63
        self.sampler = Sampler(SamplingSettings(**{**vars(sampling), "seed": seed}))
        self.greedy = sampling.is_greedy

    def _feed(self, piece: list[int]) -> torch.Tensor:
        """One forward of `piece` into the draft memory: the last token's logits (V,) float32."""
        plan = self.memory.plan(piece)
        logits = self.backend.forward(torch.tensor([piece], dtype=torch.long), plan.as_batch(), last_only=True)
        self.memory.after_forward()
        return logits[0, -1]

    def _sync(self, context: Sequence[int]) -> torch.Tensor:
        """Make the memory hold `context`; the logits (V,) after its last token."""
        held = self.memory.tokens
        common = 0
        limit = min(len(held), len(context) - 1)  # the last token is always fed: its logits are needed
        while common < limit and held[common] == context[common]:
            common += 1
        ids = list(context)
        if len(ids) >= self.backend.num_slots:  # a drafter needs only the recent past: read the tail afresh
            ids = ids[-(self.backend.num_slots // 2) :]
            common = 0
            self.memory.reset()
        self.memory.rollback(len(held) - common)
        rest = ids[common:]
        for at in range(0, len(rest) - DRAFT_CHUNK, DRAFT_CHUNK):
            self._feed(rest[at : at + DRAFT_CHUNK])
        return self._feed(rest[(len(rest) - 1) // DRAFT_CHUNK * DRAFT_CHUNK :])

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return Draft([], None)
        logits = self._sync(context)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            if i:
                logits = self._feed(tokens[-1:])
            probs.append(self.sampler.distribution(logits))
            tokens.append(int(logits.argmax()) if self.greedy else self.sampler(logits).token)
        return Draft(tokens, None if self.greedy else torch.stack(probs))


@dataclass
class Speculator:
    """What a generation speculates with: a drafter and its controller."""

    drafter: Drafter
    controller: Controller


@dataclass
class Controller:
    """Picks K, the drafts to verify in the next forward, from measured costs and acceptance.

    With a per-draft acceptance rate a (drafts accepted in order until the first rejection), a verify forward of K
    drafts yields E(K) = (1 - a^(K+1)) / (1 - a) tokens for cost(K + 1) + K x draft cost; plain decoding yields one
    token per decode step. K is the argmax of yield per second, 0 when nothing beats a decode step. A verify's cost
    is measured per width (a running figure each); a width not measured yet is guessed from the widest measured one
    below it, each further token at a share (OPTIMISM) of that verify's cost per token past the first (before any
    verify: a decode step plus PRIOR_EXTRA of one per further token), and its first verify measures it: wide
    verifies are tried where the acceptance measured so far makes them likely to pay.

    Acceptance is kept in two states, because drafts come in runs: right after a verify that kept every draft (a
    reply copying its context, where the next lookup continues the same passage: `run_rate`), and otherwise (a
    fresh match, or after a rejection or a plain step: `accept_rate`). A copying run then verifies wide, where a
    verify's cost per token is lowest, while stray matches in free text stay narrow or off."""

    max_k: int = MAX_DRAFT
    adaptive: bool = True  # False: always max_k (within the limit), whatever it costs (tests, measurements)
    accept_rate: float = 0.6  # prior, until drafts are verified (after a rejection or a plain step)
    run_rate: float = RUN_PRIOR  # the same right after a verify that kept every draft
    in_run: bool = False  # whether the last forward was a verify that kept every draft
    decode_s: float | None = None  # a decode step
    draft_s: float = 0.0  # drafting one token (0 for lookup)
    verify_s: dict[int, float] = field(default_factory=dict)  # width -> a verify forward's seconds (measured)
    passed: int = 0  # chances passed up at K = 0 since the last verify
    drafted: int = 0  # totals, for reports
    accepted: int = 0
    forwards: int = 0  # verify forwards and decode steps, for accepted_per_forward

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + EMA * (new - old)

    def record_decode(self, seconds: float) -> None:
        self.decode_s = self._ema(self.decode_s, seconds)
        self.forwards += 1
        self.in_run = False

    def record_verify(self, width: int, seconds: float, drafted: int, accepted: int) -> None:
        self.verify_s[width] = self._ema(self.verify_s.get(width), seconds)
        # Each draft kept is a success, the first rejected one a failure: the acceptance rate of this verify.
        trials = accepted + (1 if accepted < drafted else 0)
        if trials and self.in_run:
            self.run_rate = self._ema(self.run_rate, accepted / trials)
        elif trials:
            self.accept_rate = self._ema(self.accept_rate, accepted / trials)
        self.in_run = drafted > 0 and accepted == drafted
        self.drafted += drafted
        self.accepted += accepted
        self.forwards += 1

    def record_draft(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_s = self._ema(self.draft_s or None, seconds / tokens)

    def cost(self, width: int) -> float:
        """Estimated seconds of a verify forward of `width` tokens (see the class doc)."""
        assert self.decode_s is not None
        if width in self.verify_s:
            return self.verify_s[width]
        base = max((w for w in self.verify_s if w < width), default=1)
        if base == 1:
            return self.decode_s * (1 + PRIOR_EXTRA * (width - 1))
        # Each further token at OPTIMISM times what the tokens past the first cost in the widest measured verify, or
        # PRIOR_EXTRA of a decode step where that is less (a narrow verify's cost per token is the highest).
        per_token = max(self.verify_s[base] - self.decode_s, 0.0) / (base - 1)
        return self.verify_s[base] + OPTIMISM * min(per_token, PRIOR_EXTRA * self.decode_s) * (width - base)

    def _best(self, limit: int, accept_rate: float) -> int:
        """The K in [0, limit] of most tokens per second at this acceptance rate (0: plain decoding)."""
        assert self.decode_s is not None
        a = min(accept_rate, 0.999)
        best_k, best = 0, 1.0 / self.decode_s
        for k in range(1, limit + 1):
            rate = ((1 - a ** (k + 1)) / (1 - a)) / (self.cost(k + 1) + k * self.draft_s)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def choose(self, limit: int) -> int:
        """K for the next forward, at most `limit` (what the memory, the budget and the drafter allow)."""
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        if not self.adaptive:
            return limit
        if self.decode_s is None:
            return 0  # measure a decode step first
        k = self._best(limit, self.run_rate if self.in_run else self.accept_rate)
        if k:
            self.passed = 0
            return k
        # Passed up: now and then try one draft, in case acceptance has risen, unless the measured costs say no
        # acceptance could pay (then probing would only lose).
        self.passed += 1
        if self.passed >= PROBE_EVERY and self._best(limit, 1.0):
            self.passed = 0
            return 1
        return 0

    @property
    def accepted_per_forward(self) -> float:
        """Tokens a forward gave on average: 1 plain, up to K + 1 speculating."""
        return (self.forwards + self.accepted) / self.forwards if self.forwards else 0.0

    @property
    def acceptance(self) -> float:
        """Share of drafted tokens the target accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0
