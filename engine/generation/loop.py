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
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

import torch

from engine.backends.base import Backend
from engine.generation.beam import BeamForks, BeamSearch, BeamSettings, Hypothesis, check_room
from engine.generation.constrained import Grammar, TokenMask
from engine.generation.reasoning import ReasoningFormat, ReasoningSplitter, Think
from engine.generation.sampling import Sample, Sampler, SamplingSettings, make_logits_processors, make_sampler
from engine.generation.speculative import Controller, PromptLookup, Speculation, Speculator, resolve
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import Memory
from engine.model.network import ForwardCancelled

MAX_PENALTY_HISTORY = 4096


class FinishReason(StrEnum):
    """Why a generation ended; the values are OpenAI's words where OpenAI has one (see serving.protocol)."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens generated
    CANCELLED = "cancelled"  # the caller stopped it
    TOOL_CALLS = "tool_calls"  # ended by itself after tool calls (engine.tools: read back by whoever offered tools)


@dataclass
class GenerationSettings:
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    prefill_chunk: int = 256
    ignore_eos: bool = False  # benchmarks: always generate max_tokens (llama.cpp's --ignore-eos)
    # engine.generation.speculative. Off unless asked for: the app and `generate` ask for `auto`, which speculates greedy
    # replies where the backend's verifies pay; the server asks as its requests and `serve --speculative` say. Draft
    # needs a caller's Speculator.
    speculative: Speculation = Speculation.OFF
    draft_tokens: int = 0  # drafts per verify forward: 0 adapts them to measured costs and acceptance
    grammar: Grammar | None = None  # constrained output (engine.generation.constrained): JSON schema, Lark, GBNF
    top_logprobs: int = 0  # each event carries this many most likely tokens with their logprobs
    beam: BeamSettings = field(default_factory=BeamSettings)  # beams > 1: beam search (engine.generation.beam)
    # engine.generation.reasoning: the thinking asked for (read where the prompt is rendered), and how the reply is
    # split into reasoning and answer (None: all of it is the answer; set by whoever rendered the prompt).
    think: Think = Think.AUTO
    reasoning: ReasoningFormat | None = None


@dataclass(frozen=True)
class GenerationEvent:
    text: str  # new answer text since the previous event ("" while a multi-byte character, a stop string or a tag is pending)
    token: int | None  # the sampled id (None on a final event that carries no token)
    logprob: float | None
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float  # time from the call to the first sampled token
    tokens_per_s: float  # decode speed so far (tokens after the first ÷ time since the first)
    finish_reason: FinishReason | None = None
    forwards: int = 0  # decode forwards so far (with speculation one forward may give several tokens)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first, when settings ask
    beams: tuple[Hypothesis, ...] = ()  # beam search's final event: the best hypotheses, best first
    speculating: bool = False  # this reply verifies drafts (its settings ask for it and it pays here)
    reasoning: str = ""  # new reasoning text since the previous event (settings.reasoning: the think block's)


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
    reply_tokens: int = 0,
) -> torch.Tensor | None:
    """Feed `ids` in chunks of at most `chunk` tokens; returns the last token's logits (V,) float32, or None when
    `should_stop` turned true (the chunks fed before stay in memory; the one it stopped is taken back whole).
    The slot table grows once, before the first chunk, for the prompt and the `reply_tokens` that may follow it.

    Tokens that the memory can restore from its prefix cache are not recomputed (the last one always is, since its
    logits are needed). A memory with the optional `prefill_cut(ids, start)` (the cascade: to snapshot its state
    for later prompts, and to route a prompt's last tokens with the queries just before them) may name indices of
    `ids` where chunks must end; chunks after a cut count from there.
    `should_stop` is polled before every chunk and between the layers of each (Backend.forward), so a Stop while a
    long prompt is read acts within one layer; the chunk it interrupts is rolled back (Memory.rollback), so the
    memory holds exactly the chunks before it.
    """
    ids = list(ids)
    if not ids:
        raise ValueError("prefill needs at least one token")
    t0 = time.perf_counter()
    start = memory.reuse_prefix(ids[:-1])
    backend.expect(memory.slots_after(len(ids) - start + reply_tokens))
    chunk = max(1, min(chunk, memory.max_feed()))
    feed = prompt_feed(backend, memory, ids, start)
    logits = None
    if on_progress is not None:
        on_progress(PrefillProgress(feed.at, len(ids), start, 0.0))
    while not feed.done:
        if should_stop():
            return None
        logits = feed_step(backend, memory, feed.next(chunk), should_stop)
        if logits is None:
            return None
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
    chunk boundary falls where the memory asked, whoever drives the feed). With `image_from` (the vocabulary size:
    a picture's tokens are the ids from there up, engine.vision), a chunk that the size limit would end inside a
    picture's run of ids ends before the run instead, unless the run began the chunk; cuts stay where they are.
    With `whole_runs` too (a model whose pictures attend both ways: the most tokens one forward may take), a run is
    never cut: a chunk or a cut that would end inside one ends before it, and a chunk the run begins grows to hold
    it (up to `whole_runs` tokens; a longer run is cut there, and its pieces no longer see each other both ways)."""

    def __init__(
        self, ids: Sequence[int], start: int, cuts: Sequence[int], image_from: int | None = None, whole_runs: int = 0
    ) -> None:
        self.ids = list(ids)
        self.at = start  # index in the prompt of the next id to feed
        self.cuts = sorted(cuts)
        self.image_from = image_from
        self.whole_runs = whole_runs if image_from is not None else 0

    @property
    def done(self) -> bool:
        return self.at >= len(self.ids)

    def next(self, chunk: int) -> list[int]:
        n = self._size(self.at, chunk)
        piece = self.ids[self.at : self.at + n]
        self.at += len(piece)
        return piece

    def _size(self, at: int, chunk: int) -> int:
        """The size of the chunk that starts at `at`."""
        n = min([chunk, *(c - at for c in self.cuts if c > at)])
        first = self.image_from
        if first is None or at + n >= len(self.ids) or self.ids[at + n] < first or self.ids[at + n - 1] < first:
            return n  # no limit given, or the chunk cuts no run
        if not self.whole_runs and n < chunk:
            return n  # a cut: it stays
        begin = at + n
        while begin > at and self.ids[begin - 1] >= first:
            begin -= 1
        if begin > at:
            return begin - at  # end before the run
        if not self.whole_runs:
            return n  # the run began the chunk: fed in pieces
        end = at + n
        while end < len(self.ids) and self.ids[end] >= first:
            end += 1
        return max(n, min(end - at, self.whole_runs))

    def steps(self, chunk: int) -> int:
        """How many `next(chunk)` calls feed the rest."""
        at, steps = self.at, 0
        if self.image_from is not None:
            while at < len(self.ids):
                at, steps = at + self._size(at, chunk), steps + 1
            return steps
        end = len(self.ids)
        bounds = sorted({end, *(c for c in self.cuts if self.at < c < end)})
        for b in bounds:
            steps += -(-(b - at) // chunk)
            at = b
        return steps


def prompt_feed(backend: Backend, memory: Memory, ids: Sequence[int], start: int) -> PromptFeed:
    """The feed of `ids` from `start` for `backend`'s model into `memory`: chunks end at the memory's cuts, and
    before a picture's run they would cut (a model whose pictures attend both ways reads each run in one forward,
    as large as the memory takes at once)."""
    config = getattr(backend, "config", None)  # Backend declares it; a stand-in without one feeds no pictures
    whole = memory.max_feed() if getattr(config, "images_bidirectional", False) else 0
    cuts = prefill_cuts(memory, list(ids), start)
    return PromptFeed(ids, start, cuts, image_from=getattr(config, "vocab_size", None), whole_runs=whole)


def verify_forward(backend: Backend, memory: Memory, piece: list[int]) -> torch.Tensor:
    """Feed `piece` (the last sampled token and its drafts) in one forward: the logits (T, V) float32 at every
    position. The memory hears `after_forward` only from `settle`, once the rejected drafts are taken back."""
    plan = memory.plan(piece)
    return backend.forward(torch.tensor([piece], dtype=torch.long), plan.as_batch())[0]  # (T, V)


def settle(memory: Memory, taken_back: int) -> None:
    """After a verify forward: take back its last `taken_back` tokens (0 too: the memory hears it was a verify), then
    let the memory record the rest."""
    memory.rollback(taken_back)
    memory.after_forward()


def decode_step(backend: Backend, memory: Memory, token: int) -> torch.Tensor:
    """Feed one token; returns its logits (V,) float32."""
    logits = feed_step(backend, memory, [token])
    assert logits is not None  # nothing can stop it midway
    return logits


def feed_step(
    backend: Backend, memory: Memory, piece: list[int], should_stop: Callable[[], bool] | None = None
) -> torch.Tensor | None:
    """One step: place `piece` in memory, run it, let memory record it; the last token's logits (V,) float32.
    None when `should_stop` stopped the forward between two layers: the step is taken back whole."""
    plan = memory.plan(piece)
    try:
        logits = backend.forward(
            torch.tensor([piece], dtype=torch.long), plan.as_batch(), last_only=True, should_stop=should_stop
        )  # (1, 1, V)
    except ForwardCancelled:
        memory.rollback(len(piece))
        return None
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
    The repetition penalty looks at the reply's own last `repetition_window` tokens, as llama.cpp's sampler does
    (it accepts only sampled tokens): a loop guard for the reply. Penalising the prompt too (transformers' way)
    pushes a small model off the question's own words and off the end-of-turn token its template is full of.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_tokens: int,
        settings: GenerationSettings,
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
        self.pieces: list[str] = []  # the answer text emitted so far, event by event
        self.reasoning_pieces: list[str] = []  # and the reasoning text
        self.splitter = ReasoningSplitter(settings.reasoning) if settings.reasoning is not None else None
        self.finish_reason: FinishReason | None = None
        self.t0 = time.perf_counter() if t0 is None else t0
        self.t_first = self.t0
        self.forwards = 0  # decode forwards (the caller counts them)
        self.speculating = False  # the caller verifies drafts (GenerationEvent.speculating)

    def process(self, logits: torch.Tensor, ahead: Sequence[int] = ()) -> torch.Tensor:
        """logits (V,) through this request's processors, as if `ahead` had been accepted after the reply so far."""
        if not self.processors:
            return logits
        history = torch.tensor((self.tokens + list(ahead))[-self.window :], dtype=torch.long)
        for proc in self.processors:
            logits = proc(history, logits)
        return logits

    def pick(self, logits: torch.Tensor) -> Sample:
        """logits (V,) -> the next token, through this request's grammar mask, processors and sampler."""
        if self.mask is not None:
            logits = self.mask.apply(logits)
        logits = self.process(logits)
        if self.settings.top_logprobs:
            top = torch.log_softmax(logits.float(), dim=-1).topk(self.settings.top_logprobs)  # (k,) values, ids
            self.top = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        return self.sample(logits)

    def verify(self, logits: torch.Tensor, drafts: Sequence[int], probs: torch.Tensor | None) -> list[Sample]:
        """logits (K+1, V) of a verify forward over [last token, drafts] -> the tokens it gives: the drafts the
        sampler's rule keeps, then one of its own (a correction, or a bonus after all K). Never with a grammar mask
        or top logprobs (`speculator_for` turns speculation off for those)."""
        assert isinstance(self.sample, Sampler)  # speculation runs only with a Sampler (stream_generate)
        out: list[Sample] = []
        for j, d in enumerate(drafts):
            got, kept = self.sample.verify(self.process(logits[j], drafts[:j]), d, None if probs is None else probs[j])
            out.append(got)
            if not kept:
                return out
        out.append(self.sample(self.process(logits[len(drafts)], drafts)))
        return out

    def accept(self, token: int, logprob: float, should_stop: Callable[[], bool] = lambda: False) -> GenerationEvent:
        """Record a sampled token and return its event, final when the reply ends here. `should_stop` is asked only
        when nothing else ended the reply: when true, the reply ends here as cancelled."""
        n = len(self.tokens) + 1
        if n == 1:
            self.t_first = time.perf_counter()
        self.tokens.append(token)
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
        reasoning = ""
        if self.splitter is not None:  # stop strings and EOS were found in the whole text; the split comes after
            reasoning, text = self.splitter.push(text)
            if reason is not None:
                more_reasoning, more_text = self.splitter.flush()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if text:
            self.pieces.append(text)
        if reasoning:
            self.reasoning_pieces.append(reasoning)
        self.finish_reason = reason
        top = self.top if token is not None else ()
        return GenerationEvent(
            text,
            token,
            logprob,
            self.prompt_tokens,
            n,
            self.t_first - self.t0 if n else 0.0,
            rate,
            reason,
            self.forwards,
            top,
            speculating=self.speculating,
            reasoning=reasoning,
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
    speculator: Speculator | None = None,
) -> Iterator[GenerationEvent]:
    """Prefill `prompt_ids` after what `memory` holds, then sample up to `settings.max_tokens` tokens, one event each.

    The last sampled token is *not* fed back (as in every generate loop); a caller that continues later feeds it
    first. `should_stop` is polled before every prefill chunk and after every sampled token, so cancelling takes
    effect within one chunk or one token; a Stop while the prompt is read ends with one "cancelled" event and no
    token. `on_prefill` hears how far the prompt's reading got (called on the generating thread).

    Speculation (`settings.speculative`, engine.generation.speculative): `speculator` drafts and picks how many
    drafts each forward verifies; without one, `auto` and `lookup` speculate by prompt lookup. Tokens are the ones
    plain decoding gives (greedy) or drawn from the same distribution (sampled); the memory never keeps a rejected
    draft, nor a token after the one a reply ended on.
    """
    if settings.beam.beams > 1:
        yield from beam_generate(
            backend, memory, tokenizer, prompt_ids, settings, should_stop=should_stop, on_prefill=on_prefill
        )
        return
    reply = Reply(tokenizer, len(prompt_ids), settings, sampler=sampler)
    spec = speculator_for(settings, reply, speculator, backend)
    chunk = pacer.prefill_chunk(settings.prefill_chunk) if pacer else settings.prefill_chunk
    if should_stop():
        yield reply.cancel()
        return
    logits = prefill(
        backend,
        memory,
        prompt_ids,
        chunk,
        should_stop=should_stop,
        on_progress=on_prefill,
        reply_tokens=max(0, settings.max_tokens),
    )
    if logits is None:
        yield reply.cancel()
        return
    if settings.max_tokens < 1:  # read the prompt only (a session bringing memory in step with a transcript)
        return
    samples, fed = [reply.pick(logits)], 0  # fed: tokens the last forward fed beyond the one it started from
    while True:
        events = take(reply, samples, should_stop)
        if fed:
            settle(memory, fed + 1 - len(events))  # it holds the last token, then one per event but the final one
        yield from events
        if events[-1].finish_reason is not None:
            return
        if pacer:
            pacer.before_step(should_stop)  # may sleep (cool-down) or hold (thermal pause) until should_stop
            if should_stop():
                yield reply.cancel()
                return
        token = samples[-1].token
        if spec is None:
            samples, fed = [reply.pick(decode_step(backend, memory, token))], 0
        else:
            samples, fed = speculative_step(backend, memory, reply, token, spec)
        reply.forwards += 1


def take(reply: Reply, samples: list[Sample], should_stop: Callable[[], bool]) -> list[GenerationEvent]:
    """The events of `samples` in order, up to the first final one."""
    events: list[GenerationEvent] = []
    for token, logprob in samples:
        events.append(reply.accept(token, logprob, should_stop))
        if events[-1].finish_reason is not None:
            break
    return events


def speculator_for(
    settings: GenerationSettings, reply: Reply, given: Speculator | None, backend: Backend
) -> Speculator | None:
    """The speculator a generation on `backend` runs with, which `reply` records (GenerationEvent.speculating): none
    when off (`auto` where verifying does not pay there: engine.generation.speculative `resolve`), when the sampler
    is not ours (the rejection rule needs its distribution), or under a grammar or top logprobs (the mask and the
    alternatives follow each accepted token, which a verify of several drafts does not)."""
    mode = resolve(Speculation(settings.speculative), backend, settings.sampling)
    spec: Speculator | None
    ours = isinstance(reply.sample, Sampler)
    if mode is Speculation.OFF or not ours or settings.grammar is not None or settings.top_logprobs:
        spec = None
    elif given is not None:
        spec = given
    elif mode is Speculation.DRAFT:
        raise ValueError("draft speculation needs a Speculator with the draft model")
    else:
        spec = Speculator(PromptLookup(), controller_for(settings))
    reply.speculating = spec is not None
    return spec


def controller_for(settings: GenerationSettings) -> Controller:
    """Adaptive, or a fixed number of drafts when the settings name one."""
    n = settings.draft_tokens
    return Controller(max_k=n, adaptive=False) if n > 0 else Controller()


def speculative_step(
    backend: Backend, memory: Memory, reply: Reply, token: int, spec: Speculator
) -> tuple[list[Sample], int]:
    """Feed `token` with the drafts the controller asks for: the samples this forward gives, and how many drafts
    it fed (the memory holds them until `settle`). Without drafts, a plain decode step."""
    ctl = spec.controller
    budget = reply.settings.max_tokens - len(reply.tokens) - 1  # a verify gives up to K + 1 tokens
    k = ctl.choose(min(budget, memory.speculation_room() - 1))
    t0 = time.perf_counter()
    draft = spec.drafter.propose([*memory.tokens, token], k) if k > 0 else None
    t1 = time.perf_counter()
    if draft is None or not draft.tokens:
        sample = reply.pick(decode_step(backend, memory, token))
        ctl.record_decode(time.perf_counter() - t1)
        return [sample], 0
    ctl.record_draft(len(draft.tokens), t1 - t0)
    logits = verify_forward(backend, memory, [token, *draft.tokens])  # (K+1, V)
    samples = reply.verify(logits, draft.tokens, draft.probs)
    ctl.record_verify(len(draft.tokens) + 1, time.perf_counter() - t1, len(draft.tokens), len(samples) - 1)
    return samples, len(draft.tokens)


def beam_generate(
    backend: Backend,
    memory: Memory,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    settings: GenerationSettings,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    on_prefill: Callable[[PrefillProgress], None] | None = None,
) -> Iterator[GenerationEvent]:
    """Beam search (engine.generation.beam): prefill as `stream_generate` does, then one forward per step feeds every
    running beam's token over forks of `memory`. The best reply's events come once the search ends (the final one
    carries the best `settings.beam.returned` hypotheses); then the memory holds the reply but its last token, as
    after `stream_generate`. `should_stop` is polled before every chunk and every step: a stopped search replies
    with its best beam so far, "cancelled"."""
    if settings.grammar is not None:
        raise ValueError("beam search does not run under a grammar")
    reply = Reply(tokenizer, len(prompt_ids), settings)
    if should_stop():
        yield reply.cancel()
        return
    logits = prefill(
        backend, memory, prompt_ids, settings.prefill_chunk, should_stop=should_stop, on_progress=on_prefill
    )
    if logits is None:
        yield reply.cancel()
        return
    if settings.max_tokens < 1:
        return
    view = memory.fork_view()
    check_room(view, settings.max_tokens)
    search = BeamSearch(settings.beam, reply.eos, settings.max_tokens)
    # A reply's tokens are text: any text id after the memory's tokens has their offsets.
    forks = BeamForks(backend, view, backend.position_offsets([*memory.tokens, 0], 1))
    step, stopped = search.step(logits[None]), False  # the prompt's logits are the one beam's
    t_first = time.perf_counter()  # the first token is chosen: the search's time to first token
    while not search.done:
        if should_stop():
            stopped = True
            break
        step = search.step(forks.feed(step))  # (R, V) logits of the running beams
        reply.forwards += 1
    best = search.best()[: settings.beam.returned]
    events: list[GenerationEvent] = []
    chosen = best[0]
    for i, (token, logprob) in enumerate(zip(chosen.tokens, chosen.logprobs, strict=True)):
        cancel = stopped and i == len(chosen.tokens) - 1  # a stopped search ends on its best beam so far
        events.append(reply.accept(token, logprob, lambda cancel=cancel: cancel))  # type: ignore[misc]
        if events[-1].finish_reason is not None:
            break
    # A hypothesis ends on EOS or the budget, a stopped search's beam on the stop: its last event is final.
    assert events[-1].finish_reason is not None
    # The events come after the search: their timings are the search's (its first token, then its steps' rate).
    n, took = len(events), time.perf_counter() - t_first
    ttft, rate = t_first - reply.t0, (n - 1) / took if n > 1 and took > 0 else 0.0
    events = [replace(e, ttft_s=ttft, tokens_per_s=rate) for e in events]
    events[-1] = replace(events[-1], beams=tuple(best))
    fed, chunk = reply.tokens[:-1], max(1, min(settings.prefill_chunk, memory.max_feed()))
    for at in range(0, len(fed), chunk):  # the forks are gone: the memory takes the reply as a prompt would
        feed_step(backend, memory, fed[at : at + chunk])
    yield from events
