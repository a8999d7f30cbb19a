"""Batching: many prompts through one slot table, giving the same tokens as running each alone (greedy or seeded).

Each row runs the one generation loop of `engine.generation.loop` (a `PromptFeed` and a `Reply` per request, in
`RowState`); this module only adds what a shared slot table needs: the scratch slot, padding, and bucketing.
`generate_batch` is static batching (the `bench batch` suite); `engine.generation.scheduler` runs the same rows with
requests joining and leaving (the server).

Every row of the slot table is one sequence with its own `Memory`. A step feeds each row a different number of
tokens (a prefill chunk, one decode token, or nothing), so the step's token tensor is padded to the longest feed.

Padding, and why it is harmless: the slot table is allocated with one extra *scratch* slot per row, slot 0, which
no memory knows about — each row's memory is built over `RowView`, the backend with slot 0 hidden (memory slot i is
table slot i + 1). A padding token writes its K/V to the scratch slot and attends only to the scratch slot, so
  - it never overwrites a real token's K/V and no real token ever attends to it (the scratch column of every real
    token's mask is False);
  - its attention row is never all-False, so softmax has one finite entry and no NaN appears anywhere.
The scratch slot is first, not last, because a forward attends only over the leading S' slots (see SlotBatch):
at the front it costs one column, at the back it would make every step pay for the whole table.
Feeds are left-padded (real tokens at the end of the row), so `last_only` logits are each row's real last token.

Bucketing: `generate_batch` sorts prompts by length and runs them in groups of at most `max_batch` rows, so rows
of similar length share a batch; within a group prompts are aligned on the right (in whole prefill chunks), so every
row finishes its prefill in the same step and decode steps carry no padding at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from engine.backends.base import Backend, BackendWrapper
from engine.generation.loop import (
    FinishReason,
    GenerationEvent,
    GenerationSettings,
    Reply,
    prompt_feed,
    settle,
    speculator_for,
)
from engine.generation.sampling import sample_greedy
from engine.generation.speculative import Speculator
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory, RowPlan
from engine.model.network import SlotBatch

RowMemoryFactory = Callable[[Backend, int], Memory]  # (backend as the row sees it, row index) -> that row's memory


class RowView(BackendWrapper):
    """The backend as one row's memory sees it: the same slot table with the scratch slot 0 hidden."""

    @property
    def num_slots(self) -> int:
        return self.inner.num_slots - 1

    def read_kv(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read_kv(row, slots + 1)

    def write_kv(self, row: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.write_kv(row, slots + 1, k, v)


class RowBatcher:
    """Runs one padded forward over every row of a slot table allocated with a scratch slot 0 per row."""

    def __init__(self, backend: Backend, pad_id: int = 0) -> None:
        self.backend = backend
        self.rows = backend.batch
        self.pad_id = pad_id

    def forward(self, feeds: Sequence[Sequence[int]], plans: Sequence[RowPlan | None]) -> torch.Tensor:
        """feeds[r]: ids fed to row r (may be empty); plans[r]: its memory's plan (None when empty).

        Returns the last real token's logits per row, (B, V) float32 (rows fed nothing hold padding logits).
        """
        return self.forward_tail(feeds, plans, 1)[:, 0]

    def forward_tail(self, feeds: Sequence[Sequence[int]], plans: Sequence[RowPlan | None], tail: int) -> torch.Tensor:
        """As `forward`, with the logits of each row's last `tail` positions, (B, tail, V) float32: a speculating
        row's verify needs them at every token it fed (feeds are left-padded, so they are the row's last ones)."""
        b = self.rows
        if getattr(self.backend, "runs_leading_rows", False):  # rows past the last busy one cost nothing
            b = 1 + max((r for r, p in enumerate(plans) if p is not None), default=0)
        t = max(1, max(len(f) for f in feeds))
        live = 1 + max((p.slot_positions.shape[0] for p in plans if p is not None), default=0)  # S', scratch included
        tokens = torch.full((b, t), self.pad_id, dtype=torch.long)  # (B, T)
        positions = torch.zeros((b, t), dtype=torch.long)  # (B, T)
        write_slots = torch.zeros((b, t), dtype=torch.long)  # (B, T) padding writes to the scratch slot 0
        slot_positions = torch.zeros((b, live), dtype=torch.long)  # (B, S')
        mask = torch.zeros((b, 1, t, live), dtype=torch.bool)  # (B, 1, T, S')
        mask[:, :, :, 0] = True  # padding attends to the scratch slot only (cleared below for real tokens)
        local = mask.clone() if any(p is not None and p.local_mask is not None for p in plans) else None
        weights = torch.zeros((b, t))  # (B, T) each row's real tokens share its query summary; padding has no say
        offsets = (
            torch.zeros((b, t, 3), dtype=torch.long)
            if any(p is not None and p.offsets is not None for p in plans)
            else None
        )
        for r, plan in enumerate(plans):
            if plan is None:
                continue
            off = t - len(feeds[r])  # left padding
            n = plan.slot_positions.shape[0]
            tokens[r, off:] = torch.as_tensor(feeds[r], dtype=torch.long)
            positions[r, off:] = plan.positions
            write_slots[r, off:] = plan.write_slots + 1
            slot_positions[r, 1 : n + 1] = plan.slot_positions
            mask[r, 0, off:, 1 : n + 1] = plan.mask
            mask[r, 0, off:, 0] = False
            weights[r, off:] = 1.0 / len(feeds[r])
            if offsets is not None and plan.offsets is not None:  # multimodal rotary (SlotBatch.offsets)
                offsets[r, off:] = plan.offsets
            if local is not None:  # sliding-window layers' view (engine.model.slots.SlotBatch.local_mask)
                local[r, 0, off:, 1 : n + 1] = plan.mask if plan.local_mask is None else plan.local_mask
                local[r, 0, off:, 0] = False
        batch = SlotBatch(
            positions, write_slots, slot_positions, mask, summary_weights=weights, local_mask=local, offsets=offsets
        )
        tail = min(tail, t)
        logits = self.backend.forward(tokens, batch, last_only=tail == 1)  # (b, 1, V) or (b, T, V)
        out = logits[:, -tail:]  # (b, tail, V)
        if b < self.rows:  # callers index rows of the whole table; rows past b were fed nothing
            out = torch.cat((out, out.new_zeros(self.rows - b, *out.shape[1:])))
        return out


@dataclass
class Completion:
    """A finished request: what `generate_batch` returns per prompt and what a scheduler future resolves to."""

    tokens: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    ttft_s: float
    tokens_per_s: float
    cached_tokens: int = 0  # leading prompt tokens not computed: kept in the row's memory or restored from L3
    forwards: int = 0  # decode forwards (verifies included): the tokens after the first came from these
    speculated: bool = False  # the request ran with a speculator (drafts where its controller found they pay)
    drafted_tokens: int = 0  # speculation: drafts verified, and how many of them the target accepted
    accepted_tokens: int = 0
    verify_forwards: int = 0  # of `forwards`, those that verified drafts
    reasoning: str = ""  # the reply's think block (settings.reasoning), apart from `text`, its answer


class RowState:
    """One request on a row: its prompt feed and its reply (the loop of `engine.generation.loop`), plus `skip`: that
    many leading steps feed nothing (right alignment in `generate_batch`).

    The row's memory may hold a finished request's conversation: when this prompt extends it, only the new ids
    are fed; otherwise the memory is reset. Leading ids the prefix cache restores are not fed either.

    Speculation (`settings.speculative`, as in engine.generation.loop's `speculative_step`): a decoding row feeds
    its last token with the drafts its controller asks for, a verify of that row inside the shared step; the memory
    hears `after_forward` only once the rejected drafts are taken back (`verify`). `speculator`: the row's drafter
    and controller, kept by the caller so that costs measured on one reply carry over to the next (without one,
    prompt lookup with a controller of its own); `backend`, the one the row's memory runs on, decides where `auto`
    speculates. Rows that do not speculate feed one token per step.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        settings: GenerationSettings,
        memory: Memory,
        backend: Backend,
        t0: float,
        skip: int = 0,
        speculator: Speculator | None = None,
    ) -> None:
        self.settings = settings
        self.memory = memory
        ids = list(prompt_ids)
        held = len(memory.tokens)
        if held and (held >= len(ids) or ids[:held] != memory.tokens):
            memory.reset()
            held = 0
        self.cached_tokens = held or memory.reuse_prefix(ids[:-1])
        self.feed = prompt_feed(backend, memory, ids, self.cached_tokens)
        self.reply = Reply(tokenizer, len(ids), settings, t0=t0)  # what memory holds is a prefix of the prompt
        self.skip = skip
        self.last: int | None = None  # sampled last, fed on the next step
        self.spec = speculator_for(settings, self.reply, speculator, backend)
        self.decoding = False  # this step feeds the last sampled token (a decode step or a verify)
        self.drafts: list[int] = []  # this step's drafts, fed after the last token
        self.probs: torch.Tensor | None = None  # (K, V) their drafter's distributions (None: proposed for sure)
        self.drafted = 0
        self.accepted = 0
        self.verifies = 0

    @property
    def prefilling(self) -> bool:
        """Prompt ids are still to be fed (the step after the last of them samples)."""
        return not self.feed.done

    def next_feed(self, chunk: int) -> list[int]:
        """The ids to feed this step: up to `chunk` prompt ids while prefilling, else the last sampled token."""
        if self.prefilling:
            if self.skip:
                self.skip -= 1
                return []
            return self.feed.next(chunk)
        assert self.last is not None
        self.decoding = True
        self.drafts, self.probs = self._draft(self.last) if self.spec is not None else ([], None)
        return [self.last, *self.drafts]

    def _draft(self, last: int) -> tuple[list[int], torch.Tensor | None]:
        """The drafts the controller asks for after `last` (none: a plain decode step)."""
        assert self.spec is not None
        ctl = self.spec.controller
        budget = self.settings.max_tokens - len(self.reply.tokens) - 1  # a verify gives up to K + 1 tokens
        k = ctl.choose(min(budget, self.memory.speculation_room() - 1))
        if k <= 0:
            return [], None
        t0 = time.perf_counter()
        draft = self.spec.drafter.propose([*self.memory.tokens, last], k)
        ctl.record_draft(len(draft.tokens), time.perf_counter() - t0)
        return draft.tokens, draft.probs

    @property
    def verifying(self) -> bool:
        """This step feeds drafts: the caller leaves `after_forward` to `verify`."""
        return bool(self.drafts)

    def stepped(self, seconds: float) -> None:
        """A decode step (not a verify) of this row ran in `seconds`: count it, and let the controller learn."""
        if not self.decoding:
            return  # the prompt's last chunk: its logits give the first token
        self.reply.forwards += 1
        if self.spec is not None:
            self.spec.controller.record_decode(seconds)

    def verify(self, logits: torch.Tensor, seconds: float, should_stop: Callable[[], bool]) -> list[GenerationEvent]:
        """logits (K+1, V) of this row's verify, which ran in `seconds` -> the events of the tokens it gives, up to
        a final one; the memory keeps the last token and the accepted drafts the reply goes on after."""
        assert self.spec is not None
        drafts = self.drafts
        samples = self.reply.verify(logits, drafts, self.probs)
        events: list[GenerationEvent] = []
        self.reply.forwards += 1
        for token, logprob in samples:
            events.append(self.accept(token, logprob, should_stop))
            if events[-1].finish_reason is not None:
                break
        settle(self.memory, len(drafts) + 1 - len(events))
        self.spec.controller.record_verify(len(drafts) + 1, seconds, len(drafts), len(samples) - 1)
        self.drafted += len(drafts)
        self.accepted += len(samples) - 1
        self.verifies += 1
        self.drafts, self.probs = [], None
        return events

    def accept(self, token: int, logprob: float, should_stop: Callable[[], bool]) -> GenerationEvent:
        self.last = token
        return self.reply.accept(token, logprob, should_stop)

    def cancel(self) -> GenerationEvent:
        return self.reply.cancel()

    def completion(self, last: GenerationEvent) -> Completion:
        reply = self.reply
        assert reply.finish_reason is not None
        return Completion(
            list(reply.tokens),
            "".join(reply.pieces),
            reply.finish_reason,
            reply.prompt_tokens,
            last.ttft_s,
            last.tokens_per_s,
            self.cached_tokens,
            reply.forwards,
            self.spec is not None,
            self.drafted,
            self.accepted,
            self.verifies,
            "".join(reply.reasoning_pieces),
        )


def sample_rows(
    states: Sequence[RowState | None],
    rows: Sequence[int],
    logits: torch.Tensor,
    should_stop: Callable[[int], bool] = lambda r: False,
    seconds: float = 0.0,
) -> list[list[GenerationEvent]]:
    """Sample the given rows of `logits` (B, P, V: each row's last P positions, P covering every verify) and
    return each row's events, in `rows` order: one, or a verifying row's accepted drafts and its own token, up to
    a final event. `should_stop(row)` says whether that row's request was cancelled meanwhile (asked as
    `Reply.accept` asks); `seconds`: what the step's forward took (the rows' controllers learn from it)."""
    active = {r: st for r in rows if (st := states[r]) is not None}
    assert len(active) == len(rows)
    last = logits[:, -1]  # (B, V)
    plain = [r for r in rows if not active[r].verifying]
    greedy = [r for r in plain if active[r].reply.plain_greedy]
    picked = dict(zip(greedy, sample_greedy(last[greedy]), strict=True)) if greedy else {}
    events: list[list[GenerationEvent]] = []
    for r in rows:
        st = active[r]
        if st.verifying:
            events.append(st.verify(logits[r, -(len(st.drafts) + 1) :], seconds, partial(should_stop, r)))
            continue
        st.stepped(seconds)
        token, logprob = picked[r] if r in picked else st.reply.pick(last[r])
        events.append([st.accept(token, logprob, partial(should_stop, r))])
    return events


def step_tail(states: Sequence[RowState | None]) -> int:
    """How many trailing positions' logits a step needs: the widest verify's, else the last token's."""
    return max((len(st.drafts) + 1 for st in states if st is not None and st.verifying), default=1)


@dataclass
class _Group:
    indices: list[int]  # positions in the caller's prompt list
    prompts: list[list[int]]


def _buckets(prompts: list[list[int]], max_batch: int) -> list[_Group]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [
        _Group(order[i : i + max_batch], [prompts[j] for j in order[i : i + max_batch]])
        for i in range(0, len(order), max_batch)
    ]


def generate_batch(
    backend: Backend,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]] | Sequence[str],
    settings: GenerationSettings,
    memory_factory: RowMemoryFactory = FullAttentionMemory,
    *,
    max_batch: int = 32,
    num_slots: int | None = None,
) -> list[Completion]:
    """Generate a reply to every prompt (ids, or text tokenized as raw completion), batched; results in input order.

    Takes over `backend`'s slot table (pass `backend.fork()` to keep another conversation's). Each group is
    allocated `num_slots` slots per row (default: its longest prompt + `max_tokens`) plus the scratch slot.
    Sampling is per row with the request's own sampler, so a seeded row draws what a lone seeded run draws.
    """
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    if any(not p for p in ids):
        raise ValueError("every prompt needs at least one token")
    results: list[Completion | None] = [None] * len(ids)
    chunk = max(1, settings.prefill_chunk)
    for group in _buckets(ids, max(1, max_batch)):
        longest = max(len(p) for p in group.prompts)
        backend.allocate(len(group.prompts), (num_slots or longest + settings.max_tokens) + 1)
        view = RowView(backend)
        memories = [memory_factory(view, r) for r in range(len(group.prompts))]
        batcher = RowBatcher(backend)
        t0 = time.perf_counter()
        # Right alignment: a row needing fewer prefill steps than the longest waits that many steps first, so all
        # rows feed their last prompt chunk in the same step and then decode in lockstep. Whole steps, not tokens:
        # each row keeps the chunk boundaries of a lone run (the cascade's result depends on them).
        rows = [RowState(tokenizer, p, settings, m, backend, t0) for p, m in zip(group.prompts, memories, strict=True)]
        steps = [st.feed.steps(chunk) for st in rows]
        for st, n in zip(rows, steps, strict=True):
            st.skip = max(steps) - n
        states: list[RowState | None] = list(rows)
        while any(st is not None for st in states):
            feeds = [st.next_feed(chunk) if st is not None else [] for st in states]
            plans = [memories[r].plan(f) if f else None for r, f in enumerate(feeds)]
            t_step = time.perf_counter()
            logits = batcher.forward_tail(feeds, plans, step_tail(states))  # (B, P, V)
            seconds = time.perf_counter() - t_step
            for r, plan in enumerate(plans):
                row = states[r]
                if plan is not None and not (row is not None and row.verifying):  # a verify settles after sampling
                    memories[r].after_forward()
            ready = [r for r, st in enumerate(states) if st is not None and feeds[r] and not st.prefilling]
            for r, evs in zip(ready, sample_rows(states, ready, logits, seconds=seconds), strict=True):
                done_row = states[r]
                if evs[-1].finish_reason is not None and done_row is not None:
                    results[group.indices[r]] = done_row.completion(evs[-1])
                    states[r] = None
    done = [c for c in results if c is not None]
    assert len(done) == len(results)
    return done
