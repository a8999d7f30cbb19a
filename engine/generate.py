"""Generation as a few small functions: chunked prefill, one-token decode steps, and `stream_generate`, which
yields one typed `GenerationEvent` per generated token (text delta, token id, logprob, timings, finish reason).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.backends.base import Backend
from engine.memory import Memory
from engine.sampling import SamplingSettings, make_logits_processors, make_sampler
from engine.tokenizer import Tokenizer

MAX_PENALTY_HISTORY = 4096
FinishReason = str  # "stop" (EOS or stop string) | "length" | "cancelled"


@dataclass
class GenerationSettings:
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    prefill_chunk: int = 256
    ignore_eos: bool = False  # benchmarks: always generate max_tokens (llama.cpp's --ignore-eos)


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
    cuts = memory.prefill_cut(ids, start) if hasattr(memory, "prefill_cut") else []
    logits = None
    at = start
    if on_progress is not None:
        on_progress(PrefillProgress(at, len(ids), start, 0.0))
    while at < len(ids):
        if should_stop():
            return None
        end = min([at + chunk, len(ids), *(c for c in cuts if at < c)])
        logits = _feed(backend, memory, ids[at:end])
        at = end
        if on_progress is not None:
            on_progress(PrefillProgress(at, len(ids), start, time.perf_counter() - t0))
    assert logits is not None
    return logits


def decode_step(backend: Backend, memory: Memory, token: int) -> torch.Tensor:
    """Feed one token; returns its logits (V,) float32."""
    return _feed(backend, memory, [token])


def _feed(backend: Backend, memory: Memory, piece: list[int]) -> torch.Tensor:
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


def stream_generate(
    backend: Backend,
    memory: Memory,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    settings: GenerationSettings,
    *,
    sampler: Callable[[torch.Tensor], tuple[int, float]] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    pacer: Pacer | None = None,
    on_prefill: Callable[[PrefillProgress], None] | None = None,
) -> Iterator[GenerationEvent]:
    """Prefill `prompt_ids`, then sample up to `settings.max_tokens` tokens, one event each.

    The last sampled token is *not* fed back (as in every generate loop); a caller that continues later feeds it
    first. `should_stop` is polled before every prefill chunk and every step, so cancelling takes effect within
    one chunk or one token; a Stop while the prompt is read ends with one "cancelled" event and no token.
    `on_prefill` hears how far the prompt's reading got (called on the generating thread).
    """
    t0 = time.perf_counter()
    s = settings.sampling
    sample = sampler or make_sampler(s)
    processors = make_logits_processors(s)
    # The penalty looks at the last `repetition_window` tokens; 0 means "all", capped so cost stays flat per token.
    window = s.repetition_window or MAX_PENALTY_HISTORY
    history: list[int] = list(memory.tokens[-window:]) + list(prompt_ids)
    detok = tokenizer.stream_decoder()
    stops = StopMatcher(settings.stop)
    eos = frozenset() if settings.ignore_eos else tokenizer.eos_ids
    chunk = pacer.prefill_chunk(settings.prefill_chunk) if pacer else settings.prefill_chunk

    def event(text: str, token: int | None, logprob: float | None, n: int, reason: FinishReason | None) -> GenerationEvent:
        now = time.perf_counter()
        rate = (n - 1) / (now - t_first) if n > 1 and now > t_first else 0.0
        return GenerationEvent(text, token, logprob, len(prompt_ids), n, t_first - t0, rate, reason)

    t_first = t0
    if should_stop():
        yield GenerationEvent("", None, None, len(prompt_ids), 0, 0.0, 0.0, "cancelled")
        return
    read = prefill(backend, memory, prompt_ids, chunk, should_stop=should_stop, on_progress=on_prefill)
    if read is None:
        yield GenerationEvent("", None, None, len(prompt_ids), 0, 0.0, 0.0, "cancelled")
        return
    logits = read
    for n in range(1, settings.max_tokens + 1):
        for proc in processors:
            logits = proc(torch.tensor(history[-window:], dtype=torch.long), logits)
        token, logprob = sample(logits)
        if n == 1:
            t_first = time.perf_counter()
        history.append(token)
        if token in eos:
            yield event(stops.flush() + detok.flush(), token, logprob, n, "stop")
            return
        text, stopped = stops.push(detok.add(token))
        if stopped:
            yield event(text, token, logprob, n, "stop")
            return
        if n == settings.max_tokens:
            yield event(text + stops.push(detok.flush())[0] + stops.flush(), token, logprob, n, "length")
            return
        if should_stop():
            yield event(text + stops.flush(), token, logprob, n, "cancelled")
            return
        yield event(text, token, logprob, n, None)
        if pacer:
            pacer.before_step(should_stop)  # may sleep (cool-down) or hold (thermal pause) until should_stop
            if should_stop():
                yield event(stops.flush() + detok.flush(), None, None, n, "cancelled")
                return
        logits = decode_step(backend, memory, token)
