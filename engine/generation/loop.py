"""The one generation loop: chunked prefill, one-token decode steps, and what turns a sampled token into a typed
`GenerationEvent` (text delta, token id, logprob, timings, finish reason).

Every path generates through the same two pieces: `PromptFeed` (which prompt ids go in the next forward, in chunks
ending where the memory asks) and `Reply` (grammar mask, processors, sampler, detokenizer, stop strings, EOS, the token budget,
cancellation, the events). `stream_generate` drives one of each for a single request; the batch and the server's
scheduler (`engine.generation.batch`, `engine.generation.scheduler`) drive one per row of a slot table, so a request
produces the same events whichever path runs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import torch

from engine.backends.base import Backend
from engine.generation.constrained import Grammar, TokenMask
from engine.generation.sampling import Sample, Sampler, SamplingSettings, make_logits_processors, make_sampler
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import Memory

MAX_PENALTY_HISTORY = 4096


class FinishReason(StrEnum):
    """Why a generation ended; the values are OpenAI's words where OpenAI has one (see serving.protocol)."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens generated
    CANCELLED = "cancelled"  # the caller stopped it


@dataclass
class GenerationSettings:
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    prefill_chunk: int = 256
    ignore_eos: bool = False  # benchmarks: always generate max_tokens (llama.cpp's --ignore-eos)
    grammar: Grammar | None = None  # constrained output (engine.generation.constrained): JSON schema, Lark, GBNF
    top_logprobs: int = 0  # each event carries this many most likely tokens with their logprobs


@dataclass(frozen=True)
class GenerationEvent:
    text: str  # new text since the previous event (may be "" while a multi-byte character or stop string is pending)
    token: int | None  # the sampled id (None on a final event that carries no token)
    logprob: float | None
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float  # time from the call to the first sampled token
    tokens_per_s: float  # decode speed so far (tokens after the first ÷ time since the first)
    finish_reason: FinishReason | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first, when settings ask


@dataclass(frozen=True)
class PrefillProgress:
    """How far the reading of a prompt got: after the prefix cache's reuse, then after every chunk."""

    done: int  # prompt tokens in memory (reused + computed)
    total: int  # prompt tokens to read
    reused: int  # of `done`, restored from the prefix cache instead of computed
    elapsed_s: float  # since the reading began


class Pacer(Protocol):
    """Hardware policy hook (engine.hw): may shrink prefill chunks, sleep between tokens, or hold while paused."""

    def prefill_chunk(self, requested: int) -> int: ...

    def before_step(self, should_stop: Callable[[], bool]) -> None: ...


def prefill(
    backend: Backend,
    memory: Memory,
    ids: Sequence[int],
    chunk: int,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    on_progress: Callable[[PrefillProgress], None] | None = None,
) -> torch.Tensor | None:
    """Feed `ids` in chunks of at most `chunk` tokens; returns the last token's logits (V,) float32, or None when
    `should_stop` turned true between two chunks (the chunks already fed stay in memory).

    Tokens that the memory can restore from its prefix cache are not recomputed (the last one always is, since its
    logits are needed). A memory with the optional `prefill_cut(ids, start)` (the cascade: to snapshot its state
    for later prompts, and to route a prompt's last tokens with the queries just before them) may name indices of
    `ids` where chunks must end; chunks after a cut count from there.
    `should_stop` is polled before every chunk, so a Stop while a long prompt is read acts within one chunk.
    """
    ids = list(ids)
    if not ids:
        raise ValueError("prefill needs at least one token")
    t0 = time.perf_counter()
    start = memory.reuse_prefix(ids[:-1])
    chunk = max(1, min(chunk, memory.max_feed()))
    feed = PromptFeed(ids, start, prefill_cuts(memory, ids, start))
    logits = None
    if on_progress is not None:
        on_progress(PrefillProgress(feed.at, len(ids), start, 0.0))
    while not feed.done:
        if should_stop():
            return None
        logits = feed_step(backend, memory, feed.next(chunk))
        if on_progress is not None:
            on_progress(PrefillProgress(feed.at, len(ids), start, time.perf_counter() - t0))
    assert logits is not None
    return logits


def prefill_cuts(memory: Memory, ids: list[int], start: int) -> list[int]:
    """Indices of `ids` where a prefill chunk must end, from a memory with the optional `prefill_cut` (the cascade:
    to snapshot its state for later prompts, and to route a prompt's last tokens with the queries just before
    them); none for other memories."""
    cut: Callable[[list[int], int], list[int]] | None = getattr(memory, "prefill_cut", None)
    return list(cut(ids, start)) if cut is not None else []


class PromptFeed:
    """The prompt ids still to feed, handed out in chunks of at most `chunk` that also end at every cut (so a
    chunk boundary falls where the memory asked, whoever drives the feed)."""

    def __init__(self, ids: Sequence[int], start: int, cuts: Sequence[int]) -> None:
        self.pending = list(ids[start:])  # prompt ids not fed yet
        self.at = start  # index in the prompt of pending[0]
        self.cuts = sorted(cuts)

    @property
    def done(self) -> bool:
        return not self.pending

    def next(self, chunk: int) -> list[int]:
        n = min([chunk, *(c - self.at for c in self.cuts if c > self.at)])
        piece, self.pending = self.pending[:n], self.pending[n:]
        self.at += len(piece)
        return piece

    def steps(self, chunk: int) -> int:
        """How many `next(chunk)` calls feed the rest."""
        end = self.at + len(self.pending)
        bounds = sorted({end, *(c for c in self.cuts if self.at < c < end)})
        at, steps = self.at, 0
        for b in bounds:
            steps += -(-(b - at) // chunk)
            at = b
        return steps


def decode_step(backend: Backend, memory: Memory, token: int) -> torch.Tensor:
    """Feed one token; returns its logits (V,) float32."""
    return feed_step(backend, memory, [token])


def feed_step(backend: Backend, memory: Memory, piece: list[int]) -> torch.Tensor:
    """One step: place `piece` in memory, run it, let memory record it; the last token's logits (V,) float32."""
    plan = memory.plan(piece)
    logits = backend.forward(torch.tensor([piece], dtype=torch.long), plan.as_batch(), last_only=True)  # (1, 1, V)
    memory.after_forward()
    return logits[0, -1]


class StopMatcher:
    """Finds stop strings in streamed text, holding back only a tail that could still become one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:  # longest suffix of pending that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Reply:
    """One request's side of the loop: sampled token in, `GenerationEvent` out.

    Applies the request's processors and sampler (`pick`), and ends the reply on EOS or a stop string ("stop"),
    after `max_tokens` ("length"), or when cancelled ("cancelled"). Every final event carries all the text still
    held back (the stop matcher's tail and the detokenizer's incomplete characters), whichever way it ended.
    `history`: the tokens before the reply the repetition penalty may look at (it keeps the last window of them).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_tokens: int,
        settings: GenerationSettings,
        history: Sequence[int],
        *,
        sampler: Callable[[torch.Tensor], Sample] | None = None,
        t0: float | None = None,
    ) -> None:
        s = settings.sampling
        self.settings = settings
        self.prompt_tokens = prompt_tokens
        self.sample = sampler or make_sampler(s)
        self.processors = make_logits_processors(s)
        # A grammar masks each step's logits before the processors; its next mask is computed during the forward.
        self.mask = TokenMask(settings.grammar, tokenizer) if settings.grammar is not None else None
        self.top: tuple[tuple[int, float], ...] = ()  # the last pick's top logprobs (settings.top_logprobs)
        # The penalty looks at the last `repetition_window` tokens; 0 means "all", capped so cost stays flat per token.
        self.window = s.repetition_window or MAX_PENALTY_HISTORY
        self.history = list(history)
        # Greedy without processors: the same as a batched argmax (engine.generation.sampling.sample_greedy), which batches use.
        self.plain_greedy = (
            isinstance(self.sample, Sampler)
            and s.is_greedy
            and not self.processors
            and self.mask is None
            and not settings.top_logprobs
        )
        self.detok = tokenizer.stream_decoder()
        self.stops = StopMatcher(settings.stop)
        self.eos = frozenset() if settings.ignore_eos else tokenizer.eos_ids
        self.tokens: list[int] = []
        self.pieces: list[str] = []  # the text emitted so far, event by event
        self.finish_reason: FinishReason | None = None
        self.t0 = time.perf_counter() if t0 is None else t0
        self.t_first = self.t0

    def pick(self, logits: torch.Tensor) -> Sample:
        """logits (V,) -> the next token, through this request's grammar mask, processors and sampler."""
        if self.mask is not None:
            logits = self.mask.apply(logits)
        for proc in self.processors:
            logits = proc(torch.tensor(self.history[-self.window :], dtype=torch.long), logits)
        if self.settings.top_logprobs:
            top = torch.log_softmax(logits.float(), dim=-1).topk(self.settings.top_logprobs)  # (k,) values, ids
            self.top = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        return self.sample(logits)

    def accept(self, token: int, logprob: float, should_stop: Callable[[], bool] = lambda: False) -> GenerationEvent:
        """Record a sampled token and return its event, final when the reply ends here. `should_stop` is asked only
        when nothing else ended the reply: when true, the reply ends here as cancelled."""
        n = len(self.tokens) + 1
        if n == 1:
            self.t_first = time.perf_counter()
        self.tokens.append(token)
        self.history.append(token)
        if token in self.eos:
            return self._event(self._held(), token, logprob, FinishReason.STOP)
        if self.mask is not None:
            self.mask.advance(token)
        text, stopped = self.stops.push(self.detok.add(token))
        if stopped:
            return self._event(text, token, logprob, FinishReason.STOP)
        if self.mask is not None and self.mask.finished:  # the grammar is complete: no need to sample EOS
            return self._event(text + self._held(), token, logprob, FinishReason.STOP)
        if n >= self.settings.max_tokens:
            return self._event(text + self._held(), token, logprob, FinishReason.LENGTH)
        if should_stop():
            return self._event(text + self._held(), token, logprob, FinishReason.CANCELLED)
        return self._event(text, token, logprob, None)

    def cancel(self) -> GenerationEvent:
        """The final event of a reply cancelled between steps: no token, the held-back text."""
        return self._event(self._held(), None, None, FinishReason.CANCELLED)

    def _held(self) -> str:
        """All text held back: the detokenizer's pending bytes go through the stop matcher first (a stop string
        may still complete with them), then whatever the matcher holds."""
        return self.stops.push(self.detok.flush())[0] + self.stops.flush()

    def _event(
        self, text: str, token: int | None, logprob: float | None, reason: FinishReason | None
    ) -> GenerationEvent:
        now = time.perf_counter()
        n = len(self.tokens)
        rate = (n - 1) / (now - self.t_first) if n > 1 and now > self.t_first else 0.0
        if text:
            self.pieces.append(text)
        self.finish_reason = reason
        top = self.top if token is not None else ()
        return GenerationEvent(
            text, token, logprob, self.prompt_tokens, n, self.t_first - self.t0 if n else 0.0, rate, reason, top
        )


def stream_generate(
    backend: Backend,
    memory: Memory,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    settings: GenerationSettings,
    *,
    sampler: Callable[[torch.Tensor], Sample] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    pacer: Pacer | None = None,
    on_prefill: Callable[[PrefillProgress], None] | None = None,
) -> Iterator[GenerationEvent]:
    """Prefill `prompt_ids` after what `memory` holds, then sample up to `settings.max_tokens` tokens, one event each.

    The last sampled token is *not* fed back (as in every generate loop); a caller that continues later feeds it
    first. `should_stop` is polled before every prefill chunk and after every sampled token, so cancelling takes
    effect within one chunk or one token; a Stop while the prompt is read ends with one "cancelled" event and no
    token. `on_prefill` hears how far the prompt's reading got (called on the generating thread).
    """
    window = settings.sampling.repetition_window or MAX_PENALTY_HISTORY
    reply = Reply(
        tokenizer, len(prompt_ids), settings, list(memory.tokens[-window:]) + list(prompt_ids), sampler=sampler
    )
    chunk = pacer.prefill_chunk(settings.prefill_chunk) if pacer else settings.prefill_chunk
    if should_stop():
        yield reply.cancel()
        return
    logits = prefill(backend, memory, prompt_ids, chunk, should_stop=should_stop, on_progress=on_prefill)
    if logits is None:
        yield reply.cancel()
        return
    if settings.max_tokens < 1:  # read the prompt only (a session bringing memory in step with a transcript)
        return
    while True:
        token, logprob = reply.pick(logits)
        event = reply.accept(token, logprob, should_stop)
        yield event
        if event.finish_reason is not None:
            return
        if pacer:
            pacer.before_step(should_stop)  # may sleep (cool-down) or hold (thermal pause) until should_stop
            if should_stop():
                yield reply.cancel()
                return
        logits = decode_step(backend, memory, token)
