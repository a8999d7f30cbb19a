"""The server's beam-search requests (`beam_width` > 1, engine.generation.beam): the choices of one request are its
`n` best beams, so a request is one search, not `n` rows of the scheduler.

Searches run one at a time on a thread and a slot table of their own (a fork of the scheduler's backend: the weights
are shared), each over a fresh memory from the server's memory factory, through the one generation loop. Every
forward takes the service's step lock, which the scheduler's forwards take too, so the two never run the model at
once. Each choice is a `Job` as the scheduler's are (events, then a `Completion`: engine.openai.service.BeamChoice): its
events are its beam's, made by the loop's own `Reply` (text deltas, stop strings, finish reason); they come once the
search ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

from engine.backends.base import Backend
from engine.generation.batch import Completion
from engine.generation.beam import Hypothesis
from engine.generation.loop import GenerationEvent, GenerationSettings, Reply, stream_generate
from engine.generation.scheduler import Request
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import Memory


class Choice(Protocol):
    """Where one choice of a beam request goes (engine.openai.service.BeamChoice: a Job the search resolves)."""

    request: Request  # its cancel flag: the search stops once every choice is cancelled

    def deliver(self, events: Sequence[GenerationEvent], completion: Completion) -> None: ...

    def fail(self, exc: BaseException) -> None: ...

    def done(self) -> bool: ...


class BeamRunner:
    """Runs beam requests one at a time (module doc). `backend`: a fork for the searches, already step-locked."""

    def __init__(
        self, backend: Backend, tokenizer: Tokenizer, memory_factory: Callable[[Backend, int], Memory]
    ) -> None:
        self.backend, self.tokenizer, self.memory_factory = backend, tokenizer, memory_factory
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="spark-beams")
        self._closing = threading.Event()

    def start(self, ids: list[int], settings: GenerationSettings, choices: Sequence[Choice]) -> None:
        """Queue one search for `choices` (`settings.beam.returned` of them), best beam first."""
        self._pool.submit(self._run, ids, settings, list(choices))

    def close(self) -> None:
        self._closing.set()  # a running search stops at its next step
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, ids: list[int], settings: GenerationSettings, choices: list[Choice]) -> None:
        def stop() -> bool:
            return self._closing.is_set() or all(c.request.cancelled for c in choices)

        try:
            memory = self.memory_factory(self.backend, 0)
            events = list(stream_generate(self.backend, memory, self.tokenizer, ids, settings, should_stop=stop))
            final = events[-1]
            for i, choice in enumerate(choices):
                hyp = final.beams[i] if i < len(final.beams) else None
                mine = events if i == 0 else self._replay(ids, settings, hyp, final)
                tokens = [e.token for e in mine if e.token is not None]
                reason = mine[-1].finish_reason
                assert reason is not None  # the loop's final event
                text = "".join(e.text for e in mine)
                completion = Completion(tokens, text, reason, len(ids), final.ttft_s, final.tokens_per_s)
                choice.deliver(mine, completion)
        except Exception as exc:  # the choices end with the error; the server answers it (engine.openai.asgi)
            for choice in choices:
                if not choice.done():
                    choice.fail(exc)
        finally:
            self.backend.release()  # the next search's memory starts afresh

    def _replay(
        self, ids: list[int], settings: GenerationSettings, hyp: Hypothesis | None, final: GenerationEvent
    ) -> list[GenerationEvent]:
        """A lower-ranked beam's events, through the loop's `Reply` as the best one's were (with the search's
        timings); none when the search found fewer hypotheses than choices (stopped early)."""
        if hyp is None:
            return [replace(final, text="", token=None, logprob=None, generated_tokens=0, beams=())]
        reply = Reply(self.tokenizer, len(ids), settings)
        events = []
        for token, logprob in zip(hyp.tokens, hyp.logprobs, strict=True):
            events.append(reply.accept(token, logprob))
            if events[-1].finish_reason is not None:
                break
        return [replace(e, ttft_s=final.ttft_s, tokens_per_s=final.tokens_per_s) for e in events]
