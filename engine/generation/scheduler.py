"""Continuous batching: many requests share one model; they join and leave the running batch between steps.

One scheduler thread owns the backend and its slot table of `max_batch` rows (plus the scratch slot per row, see
engine.generation.batch). Every step it
  1. admits waiting requests into free rows, most urgent first (interactive chat before background work, FIFO
     within a priority); each row has its own memory, kept when its request ends, so that a request extending
     that conversation goes to that row and feeds only its new tokens (see `_pick_row`);
  2. feeds every active row: a prefill chunk, or its last sampled token, or nothing — so a step is a prefill,
     decode or mixed step depending on who is running. While any row is decoding, prefill chunks shrink to
     `mixed_chunk` tokens, because every row is padded to the longest feed: a long chunk would make each
     decoding row pay for it and stall the replies already streaming;
  3. samples the rows whose prompt is in, delivers one `GenerationEvent` each, and retires finished rows.
A request that speculates (`settings.speculative`) feeds its last token with drafts while decoding: a verify of
its row in the same step, giving it one or more events (engine.generation.batch.RowState). Each row keeps its
adaptive controller across requests, so costs measured on one reply carry over to the next. A request may bring an
`attach` hook (the server's uploaded documents): run with its row's memory, afresh, at admission, told at its first
event, and detached when it retires, the row's memory then forgotten.

Front: `submit(request) -> Future[Completion]` and `async for ev in scheduler.stream(request)`, both safe from any
thread. The waiting queue is bounded: when full, a more urgent request takes the place of the least urgent,
latest queued one (whose future fails with `QueueFull`); otherwise `submit` raises `QueueFull` or blocks,
per the `block` flag. `request.cancel()` stops one request between steps and leaves the others running.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from engine.backends.base import Backend
from engine.errors import SparkError
from engine.generation.batch import (
    Completion,
    RowBatcher,
    RowMemoryFactory,
    RowState,
    RowView,
    sample_rows,
    step_tail,
)
from engine.generation.loop import GenerationEvent, GenerationSettings, controller_for
from engine.generation.speculative import Controller, Drafter, PromptLookup, Speculation, Speculator
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory, RowPlan

DrafterFactory = Callable[[int, GenerationSettings], Drafter]  # (row, a request's settings) -> its draft model


class RowAttachment(Protocol):
    """What a request joined to its row's memory (engine.openai's documents): told when the prompt has routed the
    reply's first token, and removed once the request is over, so the row's next request sees none of it."""

    def observe(self) -> None: ...

    def detach(self) -> None: ...


Attacher = Callable[[Memory], RowAttachment]  # runs on the scheduler thread with the row's memory, at admission


class QueueFull(SparkError):
    """The scheduler's waiting queue is full (or a more urgent request took this one's place)."""


class SchedulerClosed(SparkError):
    """The scheduler was closed before this request finished."""


class Priority(IntEnum):
    INTERACTIVE = 0  # the main chat and the quick prompt: someone is watching
    BACKGROUND = 1  # summaries, indexing, API batch work


@dataclass
class SchedulerConfig:
    max_batch: int = 8  # rows of the slot table = requests running at once
    num_slots: int = 2048  # slots per row the memories see (the scratch slot is extra)
    max_queue: int = 64  # waiting requests beyond the running ones
    block_when_full: bool = False  # default for `submit(block=None)`
    mixed_chunk: int = 16  # prefill chunk while other rows are decoding
    # Prompt tokens one step may take over all rows: when many requests arrive at once, the first ones start
    # replying after a step of this size instead of after everyone's prompt (the rest join while they decode).
    step_prompt_tokens: int = 512
    # Seconds with no request running or waiting after which the rows give their slot table back (its memory
    # returns to the system; the kept conversations are forgotten, their prefixes stay in the disk cache).
    idle_release_s: float = 30.0


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation: a prompt (ids, or text encoded as raw completion), its settings and priority.

    `on_event` runs on the scheduler thread for every event, so it must be quick (hand off, don't work).
    """

    prompt: list[int] | str
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    priority: Priority = Priority.INTERACTIVE
    on_event: Callable[[GenerationEvent], None] | None = None
    attach: Attacher | None = None  # joins memory (documents) to the row's, for this request only
    id: int = field(default_factory=lambda: next(_ids))
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        """Stop this request at the next step boundary (its future resolves with finish_reason "cancelled")."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass(order=True)
class _Waiting:
    priority: int
    seq: int
    request: Request = field(compare=False)
    ids: list[int] = field(compare=False)
    future: Future[Completion] = field(compare=False)
    t0: float = field(compare=False)


def _fail(future: Future[Completion], exc: BaseException) -> None:
    with contextlib.suppress(InvalidStateError):  # cancelled through the future meanwhile: nobody waits for it
        future.set_exception(exc)


@dataclass
class _Active:
    waiting: _Waiting
    state: RowState
    attached: RowAttachment | None = None
    observed: bool = False


class Scheduler:
    """Owns `backend` (give it a fork of its own) and runs requests on a single scheduler thread."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        config: SchedulerConfig | None = None,
        memory_factory: RowMemoryFactory = FullAttentionMemory,
        drafters: DrafterFactory | None = None,
    ) -> None:
        """`drafters`: where draft-model speculation is served, each row's draft model for a request."""
        self.config = config or SchedulerConfig()
        self._drafters = drafters
        self.tokenizer = tokenizer
        backend.allocate(self.config.max_batch, self.config.num_slots + 1)
        self.backend = backend
        self._released = False  # whether the table was given back and nothing ran since
        view = RowView(backend)
        self._memories = [memory_factory(view, r) for r in range(self.config.max_batch)]
        # Each row's speculation controllers (prompt lookup's, a draft model's): measured costs outlive requests.
        self.controllers = [Controller() for _ in range(self.config.max_batch)]
        self.draft_controllers = [Controller() for _ in range(self.config.max_batch)]
        self._batcher = RowBatcher(backend)
        self._rows: list[_Active | None] = [None] * self.config.max_batch
        self._waiting: list[_Waiting] = []  # heap: most urgent, oldest first
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closing = False
        self.steps = {"prefill": 0, "decode": 0, "mixed": 0}  # how many of each kind ran (for tests and benches)
        self._thread = threading.Thread(target=self._loop, name="spark-scheduler", daemon=True)
        self._thread.start()

    # -- front (any thread) ------------------------------------------------------------------------------------
    def submit(
        self, request: Request, *, block: bool | None = None, timeout: float | None = None
    ) -> Future[Completion]:
        """Queue `request`; the future resolves to its `Completion` (or fails with the error that ended it)."""
        ids = self.tokenizer.encode(request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
        if not ids:
            raise ValueError("a request needs at least one prompt token")
        block = self.config.block_when_full if block is None else block
        future: Future[Completion] = Future()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closing:
                    raise SchedulerClosed("The scheduler is closed; no new requests are taken.")
                if len(self._waiting) >= self.config.max_queue:
                    # Futures cancelled while waiting give their places back before anyone is refused.
                    self._waiting = [w for w in self._waiting if not w.future.cancelled()]
                    heapq.heapify(self._waiting)
                if len(self._waiting) < self.config.max_queue:
                    break
                worst = max(self._waiting)
                if request.priority < worst.priority:
                    self._waiting.remove(worst)
                    heapq.heapify(self._waiting)
                    _fail(
                        worst.future,
                        QueueFull(
                            "A more urgent request took this request's place in the full queue; submit it again later."
                        ),
                    )
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if not block or (left is not None and left <= 0):
                    raise QueueFull(
                        f"The request queue is full ({self.config.max_queue} waiting); try again when a reply finishes."
                    )
                self._cond.wait(left)
            heapq.heappush(
                self._waiting,
                _Waiting(int(request.priority), next(self._seq), request, ids, future, time.perf_counter()),
            )
            self._cond.notify_all()
        return future

    async def stream(self, request: Request, *, block: bool | None = None) -> AsyncIterator[GenerationEvent]:
        """Submit `request` and yield its events as they come.

        Closing the generator early cancels the request: use `async with contextlib.aclosing(sched.stream(r))` so
        that happens at once on `break` (otherwise it happens when the event loop finalizes the generator).
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationEvent | None] = asyncio.Queue()
        inner = request.on_event

        def put(item: GenerationEvent | None) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the consumer's loop is gone: nobody is listening any more
                request.cancel()

        def on_event(ev: GenerationEvent) -> None:
            if inner is not None:
                inner(ev)
            put(ev)

        request.on_event = on_event
        blocking = self.config.block_when_full if block is None else block
        # A blocking submit waits for queue space: do that off the event loop.
        future = (
            await loop.run_in_executor(None, lambda: self.submit(request, block=True))
            if blocking
            else self.submit(request, block=False)
        )
        future.add_done_callback(lambda _: put(None))  # after the final event (same thread, FIFO), or on failure
        try:
            while (item := await queue.get()) is not None:
                yield item
            error = future.exception()
            if error is not None:
                raise error
        finally:
            if not future.done():
                request.cancel()

    def close(self, *, wait: bool = True) -> None:
        """Stop taking requests, cancel the running ones (their futures resolve "cancelled"), fail the queued ones."""
        with self._cond:
            self._closing = True
            for w in self._waiting:
                _fail(w.future, SchedulerClosed("The scheduler closed before this request started."))
            self._waiting.clear()
            for a in self._rows:
                if a is not None:
                    a.waiting.request.cancel()
            self._cond.notify_all()
        if wait:
            self._thread.join()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> int:
        return sum(a is not None for a in self._rows)

    @property
    def waiting(self) -> int:
        """Requests queued for a row (the server reports it and sizes Retry-After by it)."""
        return len(self._waiting)

    # -- scheduler thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._admit()
                while not any(self._rows) and not self._closing:
                    if not self._cond.wait(self.config.idle_release_s) and not self._waiting:
                        self._release()
                    self._admit()
                if self._closing and not any(self._rows):
                    return
            try:
                self._step()
            except Exception as exc:  # a failed forward ends the requests in it, never the scheduler
                for r, a in enumerate(self._rows):
                    if a is not None:
                        self._retire(r, error=exc)

    def _release(self) -> None:
        """Idle: every row's memory forgets its conversation and the table is given back (caller holds the lock)."""
        if self._released:
            return  # nothing ran since the last release
        for memory in self._memories:
            memory.reset()
        self.backend.release()
        self._released = True

    def _admit(self) -> None:
        """Move the most urgent waiting requests into free rows (caller holds the lock)."""
        free = [r for r, a in enumerate(self._rows) if a is None]
        while free and self._waiting:
            w = heapq.heappop(self._waiting)
            self._cond.notify_all()  # queue space for blocked submitters
            if not w.future.set_running_or_notify_cancel():
                continue  # cancelled through its future while waiting
            r = self._pick_row(free, w.ids)
            attached = None
            try:
                if w.request.attach is not None:
                    # The row's kept conversation is not this one's with attachments: start it afresh.
                    self._memories[r].reset()
                    attached = w.request.attach(self._memories[r])
                spec = self._speculator(r, w.request.settings)
                state = RowState(
                    self.tokenizer, w.ids, w.request.settings, self._memories[r], self.backend, w.t0, speculator=spec
                )
            except Exception as exc:  # bad settings, an attachment refused: this request fails, the row stays free
                if attached is not None:
                    attached.detach()
                self._memories[r].reset()
                w.future.set_exception(exc)
                continue
            free.remove(r)
            self._rows[r] = _Active(w, state, attached)
            self._released = False

    def _speculator(self, r: int, settings: GenerationSettings) -> Speculator | None:
        """Row `r`'s drafter and controller for a request (None when it does not speculate)."""
        mode = Speculation(settings.speculative)
        if mode is Speculation.OFF:
            return None
        draft = mode is Speculation.DRAFT
        if draft and self._drafters is None:
            raise ValueError("draft speculation needs a draft model, and this scheduler has none")
        held = (self.draft_controllers if draft else self.controllers)[r]
        controller = controller_for(settings) if settings.draft_tokens else held
        drafter = self._drafters(r, settings) if draft and self._drafters is not None else PromptLookup()
        return Speculator(drafter, controller)

    def _pick_row(self, free: list[int], ids: list[int]) -> int:
        """The free row for a prompt: one whose kept memory (a finished request's conversation) the prompt extends,
        the longest such; else, since a forward runs every row up to the last busy one (see RowBatcher) and an idle
        row among them pays for padding, an empty row among those, then any free row among those, then the first
        free row past them, whatever it kept (RowState forgets a kept memory the prompt does not extend)."""
        memories = self._memories
        extends = [
            r
            for r in free
            if 0 < len(memories[r].tokens) < len(ids) and ids[: len(memories[r].tokens)] == memories[r].tokens
        ]
        if extends:
            return max(extends, key=lambda r: len(memories[r].tokens))
        view = 1 + max((r for r, a in enumerate(self._rows) if a is not None), default=-1)
        inside = [r for r in free if r < view]
        return next((r for r in inside if not memories[r].tokens), inside[0] if inside else free[0])

    def _step(self) -> None:
        rows = self._rows
        for r, a in enumerate(rows):
            if a is not None and a.waiting.request.cancelled:
                self._deliver(r, a.state.cancel())
        decoding = any(a is not None and not a.state.prefilling for a in rows)
        prefilling = any(a is not None and a.state.prefilling for a in rows)
        if not (decoding or prefilling):
            return
        self.steps["mixed" if decoding and prefilling else "decode" if decoding else "prefill"] += 1
        feeds: list[list[int]] = []
        plans: list[RowPlan | None] = []
        budget = self.config.step_prompt_tokens
        for r, a in enumerate(rows):
            feed: list[int] = []
            plan = None
            if a is not None and a.state.prefilling and budget <= 0:
                pass  # this step's prompt tokens are spent: this row's prompt waits for the next step
            elif a is not None:
                # As engine.generation.loop.prefill: one step may not feed a row more than its memory takes at once.
                chunk = max(1, min(a.state.settings.prefill_chunk, self._memories[r].max_feed()))
                if a.state.prefilling:
                    chunk = min(chunk, self.config.mixed_chunk if decoding else chunk, budget)
                    budget -= chunk
                feed = a.state.next_feed(chunk)
                try:
                    plan = self._memories[r].plan(feed)
                except Exception as exc:  # e.g. the conversation outgrew the row: only this request fails
                    self._retire(r, error=exc)
                    feed = []
            feeds.append(feed)
            plans.append(plan)
        if all(p is None for p in plans):
            return
        states = [a.state if a is not None else None for a in rows]
        t_step = time.perf_counter()
        logits = self._batcher.forward_tail(feeds, plans, step_tail(states))  # (B, P, V)
        seconds = time.perf_counter() - t_step
        for r, (plan, st) in enumerate(zip(plans, states, strict=True)):
            if plan is not None and not (st is not None and st.verifying):  # a verify settles after sampling
                self._memories[r].after_forward()
        ready = [
            r
            for r, (p, st) in enumerate(zip(plans, states, strict=True))
            if p is not None and st is not None and not st.prefilling
        ]
        for r, evs in zip(ready, sample_rows(states, ready, logits, self._cancelled, seconds), strict=True):
            active = rows[r]
            for ev in evs:
                if rows[r] is not active:
                    break  # retired by its listener's failure
                self._deliver(r, ev)

    def _cancelled(self, r: int) -> bool:
        a = self._rows[r]
        return a is not None and a.waiting.request.cancelled

    def _deliver(self, r: int, ev: GenerationEvent) -> None:
        a = self._rows[r]
        assert a is not None
        if a.attached is not None and not a.observed:  # the prompt has routed the first token
            a.observed = True
            a.attached.observe()
        callback = a.waiting.request.on_event
        if callback is not None:
            try:
                callback(ev)
            except Exception as exc:  # a broken listener ends its own request only
                self._retire(r, error=exc)
                return
        if ev.finish_reason is not None:
            self._retire(r, result=a.state.completion(ev))

    def _retire(self, r: int, *, result: Completion | None = None, error: BaseException | None = None) -> None:
        a = self._rows[r]
        assert a is not None
        self._rows[r] = None
        if a.attached is not None:  # the next request on this row must not see this one's attachments
            a.attached.detach()
        if error is not None or a.attached is not None:
            self._memories[r].reset()
        if error is not None:
            a.waiting.future.set_exception(error)
        else:
            assert result is not None
            a.waiting.future.set_result(result)
