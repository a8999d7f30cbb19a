"""Static batching: many prompts through one slot table, giving the same tokens as running each alone (greedy).

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

import torch

from engine.backends.base import Backend
from engine.generate import MAX_PENALTY_HISTORY, GenerationEvent, GenerationSettings, StopMatcher
from engine.memory import FullAttentionMemory, Memory, RowPlan
from engine.model import SlotBatch
from engine.sampling import make_logits_processors, make_sampler
from engine.tokenizer import Tokenizer

RowMemoryFactory = Callable[[Backend, int], Memory]  # (backend as the row sees it, row index) -> that row's memory


class RowView:
    """The backend as one row's memory sees it: the same slot table with the scratch slot 0 hidden."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.num_slots = backend.num_slots - 1

    def read_kv(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._backend.read_kv(row, slots + 1)

    def write_kv(self, row: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._backend.write_kv(row, slots + 1, k, v)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._backend, name)


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
        weights = torch.zeros((b, t))  # (B, T) each row's real tokens share its query summary; padding has no say
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
        batch = SlotBatch(positions, write_slots, slot_positions, mask, summary_weights=weights)
        logits = self.backend.forward(tokens, batch, last_only=True)  # (b, 1, V)
        out = logits[:, -1]  # (b, V)
        if b < self.rows:  # callers index rows of the whole table; rows past b were fed nothing
            out = torch.cat((out, out.new_zeros(self.rows - b, out.shape[1])))
        return out


@dataclass
class Completion:
    """A finished request: what `generate_batch` returns per prompt and what a scheduler future resolves to."""

    tokens: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    ttft_s: float
    tokens_per_s: float
    cached_tokens: int = 0  # leading prompt tokens not computed: kept in the row's memory or restored from L3


class RowState:
    """One request's generation state on a row: what to feed next, and turning its logits into events.

    Mirrors `engine.generate.stream_generate` step for step (same sampler, processors, stop and EOS rules), so a
    row produces the events a lone run would. `skip`: that many leading steps feed nothing (right alignment).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], settings: GenerationSettings, memory: Memory, t0: float, skip: int = 0) -> None:
        s = settings.sampling
        self.settings = settings
        self.prompt_len = len(prompt_ids)
        held = len(memory.tokens)  # a row may keep a finished request's memory: continue it if this prompt extends it
        if held and (held >= len(prompt_ids) or list(prompt_ids[:held]) != memory.tokens):
            memory.reset()
            held = 0
        # Leading prompt tokens already in memory or restored from the prefix cache: not fed again.
        self.cached_tokens = held or memory.reuse_prefix(list(prompt_ids[:-1]))
        start = self.cached_tokens
        self.pending = list(prompt_ids[start:])  # prompt ids not yet fed
        self.at = start  # index in prompt_ids of pending[0]
        # Chunk ends the memory asks for (the cascade: snapshots, a prompt's routed tail), as engine.generate.prefill.
        self.cuts: list[int] = memory.prefill_cut(list(prompt_ids), start) if hasattr(memory, "prefill_cut") else []
        self.skip = skip
        self.sample = make_sampler(s)
        self.processors = make_logits_processors(s)
        self.window = s.repetition_window or MAX_PENALTY_HISTORY  # as stream_generate: 0 = all, capped
        self.history: list[int] = list(prompt_ids)  # what memory holds is a prefix of the prompt by now
        # Greedy rows without processors are sampled together in one batched argmax (see `sample_greedy`).
        self.plain_greedy = s.is_greedy and not self.processors
        self.detok = tokenizer.stream_decoder()
        self.stops = StopMatcher(settings.stop)
        self.eos = frozenset() if settings.ignore_eos else tokenizer.eos_ids
        self.tokens: list[int] = []
        self.parts: list[str] = []
        self.last: int | None = None  # sampled last, fed on the next step
        self.finish_reason: str | None = None
        self.t0 = t0
        self.t_first = t0

    def next_feed(self, chunk: int) -> list[int]:
        """The ids to feed this step: up to `chunk` prompt ids while prefilling, else the last sampled token."""
        if self.pending:
            if self.skip:
                self.skip -= 1
                return []
            n = min([chunk, *(c - self.at for c in self.cuts if c > self.at)])
            feed, self.pending = self.pending[:n], self.pending[n:]
            self.at += n
            return feed
        assert self.last is not None
        return [self.last]

    def prefill_steps(self, chunk: int) -> int:
        """How many steps next_feed(chunk) takes to feed the rest of the prompt."""
        bounds = sorted({self.at + len(self.pending), *(c for c in self.cuts if self.at < c < self.at + len(self.pending))})
        at, steps = self.at, 0
        for end in bounds:
            steps += -(-(end - at) // chunk)
            at = end
        return steps

    @property
    def samples_after_feed(self) -> bool:
        """Whether the step that just ran ends with a token to sample from (prefill done)."""
        return not self.pending

    def pick(self, logits: torch.Tensor) -> tuple[int, float]:
        """logits (V,) -> (token, logprob) with this request's processors and sampler."""
        for proc in self.processors:
            logits = proc(torch.tensor(self.history[-self.window :], dtype=torch.long), logits)
        return self.sample(logits)  # type: ignore[return-value]

    def accept(self, token: int, logprob: float) -> GenerationEvent:
        """Record a sampled token and return its event (with `finish_reason` set when the request ends here)."""
        n = len(self.tokens) + 1
        if n == 1:
            self.t_first = time.perf_counter()
        self.tokens.append(token)
        self.history.append(token)
        self.last = token
        if token in self.eos:
            return self._event(self.stops.flush() + self.detok.flush(), token, logprob, "stop")
        text, stopped = self.stops.push(self.detok.add(token))
        if stopped:
            return self._event(text, token, logprob, "stop")
        if n == self.settings.max_tokens:
            return self._event(text + self.stops.push(self.detok.flush())[0] + self.stops.flush(), token, logprob, "length")
        return self._event(text, token, logprob, None)

    def cancel(self) -> GenerationEvent:
        """The final event of a request cancelled between steps."""
        return self._event(self.stops.flush(), None, None, "cancelled")

    def _event(self, text: str, token: int | None, logprob: float | None, reason: str | None) -> GenerationEvent:
        now = time.perf_counter()
        n = len(self.tokens)
        rate = (n - 1) / (now - self.t_first) if n > 1 and now > self.t_first else 0.0
        if text:
            self.parts.append(text)
        self.finish_reason = reason
        return GenerationEvent(text, token, logprob, self.prompt_len, n, self.t_first - self.t0 if n else 0.0, rate, reason)

    def completion(self, last: GenerationEvent) -> Completion:
        assert self.finish_reason is not None
        return Completion(list(self.tokens), "".join(self.parts), self.finish_reason, self.prompt_len, last.ttft_s, last.tokens_per_s, self.cached_tokens)


def sample_greedy(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """logits (B, V) -> greedy tokens and their logprobs, the same numbers `Sampler` computes for one row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    tokens = logprobs.argmax(dim=-1)  # (B,)
    return tokens.tolist(), logprobs.gather(-1, tokens[:, None])[:, 0].tolist()


def sample_rows(states: Sequence[RowState | None], rows: Sequence[int], logits: torch.Tensor) -> list[GenerationEvent]:
    """Sample the given rows of `logits` (B, V) and return one event per row, in `rows` order."""
    greedy = [r for r in rows if states[r].plain_greedy]  # type: ignore[union-attr]
    picked: dict[int, tuple[int, float]] = {}
    if greedy:
        toks, lps = sample_greedy(logits[greedy])
        picked = {r: (t, lp) for r, t, lp in zip(greedy, toks, lps)}
    events = []
    for r in rows:
        st = states[r]
        assert st is not None
        token, logprob = picked[r] if r in picked else st.pick(logits[r])
        events.append(st.accept(token, logprob))
    return events


@dataclass
class _Group:
    indices: list[int]  # positions in the caller's prompt list
    prompts: list[list[int]]


def _buckets(prompts: list[list[int]], max_batch: int) -> list[_Group]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [_Group(order[i : i + max_batch], [prompts[j] for j in order[i : i + max_batch]]) for i in range(0, len(order), max_batch)]


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
        memories = [memory_factory(view, r) for r in range(len(group.prompts))]  # type: ignore[arg-type]
        batcher = RowBatcher(backend)
        t0 = time.perf_counter()
        # Right alignment: a row needing fewer prefill steps than the longest waits that many steps first, so all
        # rows feed their last prompt chunk in the same step and then decode in lockstep. Whole steps, not tokens:
        # each row keeps the chunk boundaries of a lone run (the cascade's result depends on them).
        states: list[RowState | None] = [RowState(tokenizer, p, settings, m, t0) for p, m in zip(group.prompts, memories)]
        steps = [st.prefill_steps(chunk) for st in states if st is not None]
        for st, n in zip(states, steps):
            assert st is not None
            st.skip = max(steps) - n
        while any(st is not None for st in states):
            feeds = [st.next_feed(chunk) if st is not None else [] for st in states]
            plans = [memories[r].plan(f) if f else None for r, f in enumerate(feeds)]
            logits = batcher.forward(feeds, plans)  # (B, V)
            for r, plan in enumerate(plans):
                if plan is not None:
                    memories[r].after_forward()
            ready = [r for r, st in enumerate(states) if st is not None and feeds[r] and st.samples_after_feed]
            for r, ev in zip(ready, sample_rows(states, ready, logits)):
                if ev.finish_reason is not None:
                    st = states[r]
                    assert st is not None
                    results[group.indices[r]] = st.completion(ev)
                    states[r] = None
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]
