"""The model behind the server: one loaded model, one scheduler (continuous batching), requests in, events out.

`ModelService` turns a parsed request into prompt ids (chat template or raw text), checks its size, and queues it
on the scheduler. Each row of the scheduler has its own memory from the engine's memory factory — the cascade over
the shared persistent (L3) store — so a request whose prompt extends an earlier one (a chat client sending the
whole conversation again) restores that prefix from L3 (exact prefix blocks while the conversation fits the window,
the cascade snapshot beyond) instead of re-reading it; `Completion.cached_tokens` says how many tokens it skipped.

`Job` bridges the scheduler thread to the event loop: events arrive on an asyncio queue; cancelling the job (the
client went away) frees its row at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.backends.base import Backend
from engine.documents.attach import MAX_ATTACHMENTS
from engine.documents.extract import Document
from engine.errors import InputTooLarge, InsufficientMemory, SparkError
from engine.generation.batch import Completion, RowMemoryFactory
from engine.generation.loop import GenerationEvent, GenerationSettings
from engine.generation.reasoning import (
    ReasoningFormat,
    history,
    opens_in_prompt,
    reasoning_style,
    switched,
    think_tokens,
)
from engine.generation.scheduler import QueueFull, Request, Scheduler, SchedulerClosed, SchedulerConfig
from engine.generation.speculative import Drafter, DraftModel, Speculation
from engine.hw.memory import allocatable_bytes, format_bytes
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import Memory
from engine.openai.beams import BeamRunner
from engine.openai.documents import RowDocuments, check_attachable
from engine.openai.errors import bad_request, busy, too_large, unavailable
from engine.openai.files import FileLimits
from engine.openai.metrics import Metrics
from engine.openai.protocol import Limits, ParsedRequest
from engine.session.setup import LockedBackend
from engine.tools.template import chat_inputs
from engine.vision.fetch import fetch_image
from engine.vision.images import decode_base64
from engine.vision.messages import template_messages
from engine.vision.model import VisionModel

DEFAULT_SLOTS = 2048  # slots per row for a memory that does not say (full attention)


def served_name(model: Path) -> str:
    """The name clients send as "model" for a model folder or GGUF file: its folder name or file stem."""
    return model.stem if model.suffix == ".gguf" else model.name


@dataclass(frozen=True)
class ServeConfig:
    model_id: str  # the name clients send as "model"
    api_key: str | None = None
    max_batch: int = 8  # requests generating at once (rows of the slot table)
    max_queue: int = 64  # requests waiting beyond those; more are refused with 429 + Retry-After
    max_prompt_tokens: int = 16384  # longer prompts are refused with 413
    max_body_bytes: int = 8 * 1024**2  # larger request bodies are refused with 413 before they are parsed
    retry_after_s: int = 2
    limits: Limits = field(default_factory=Limits)
    allow_origins: tuple[str, ...] = ()  # CORS is off unless origins are named
    speculative: Speculation = Speculation.OFF  # for requests that do not send "speculative" (where it combines)
    allow_image_urls: bool = False  # fetch http(s) image_url parts (else only data: URLs are read)
    files: FileLimits = field(default_factory=FileLimits)  # POST /v1/files (engine.openai.files)


def request_speculation(req: ParsedRequest, default: Speculation, has_draft: bool) -> Speculation:
    """How `req` speculates: as it asks (the protocol refused what does not combine), else the server's default
    where it combines (not under beams, a grammar or top logprobs: those run plainly). Draft speculation only
    where the server was started with a draft model (refused in one sentence otherwise)."""
    mode = req.speculative
    if mode is None:
        s = req.settings
        plain = s.beam.beams > 1 or s.grammar is not None or s.top_logprobs > 0
        mode = Speculation.OFF if plain else default
    if mode is Speculation.DRAFT and not has_draft:
        raise bad_request(
            'This server was started without a draft model; send "speculative": "auto" or "lookup".', "speculative"
        )
    return mode


class Job:
    """One queued request: `events()` streams its GenerationEvents, `result()` its Completion once they end."""

    def __init__(
        self,
        scheduler: Scheduler,
        request: Request,
        loop: asyncio.AbstractEventLoop,
        on_done: Callable[[Completion], None],
        documents: RowDocuments | None = None,
    ) -> None:
        self.request = request
        self.documents = documents  # what the request attached, and what its reply recalled
        self._queue: asyncio.Queue[GenerationEvent | None] = asyncio.Queue()

        def put(item: GenerationEvent | None) -> None:
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone: nobody listens any more
                request.cancel()

        request.on_event = put
        self.future = scheduler.submit(request, block=False)  # QueueFull / SchedulerClosed propagate

        def done(future: Future[Completion]) -> None:  # after the final event (same thread, in order)
            put(None)
            if not future.cancelled() and future.exception() is None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nothing left to count
                    loop.call_soon_threadsafe(on_done, future.result())

        self.future.add_done_callback(done)

    async def events(self) -> AsyncGenerator[GenerationEvent, None]:
        try:
            while (ev := await self._queue.get()) is not None:
                yield ev
        finally:
            self.cancel_unless_done()

    def cancel_unless_done(self) -> None:
        if not self.future.done():
            self.request.cancel()

    def result(self) -> Completion:
        return self.future.result(timeout=0)


class BeamChoice(Job):
    """One choice of a beam request (engine.openai.beams): a Job the search delivers rather than the scheduler."""

    def __init__(
        self, request: Request, loop: asyncio.AbstractEventLoop, on_done: Callable[[Completion], None]
    ) -> None:
        self.request = request
        self.documents = None
        self._queue = asyncio.Queue()
        self.future = Future()
        self._loop, self._on_done = loop, on_done

    def deliver(self, events: Sequence[GenerationEvent], completion: Completion) -> None:
        """On the search's thread: resolve the choice (its reader asks for the result once the events end), then
        hand the events to the event loop and count it."""
        self.future.set_result(completion)
        with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody listens any more
            for ev in [*events, None]:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, ev)
            self._loop.call_soon_threadsafe(self._on_done, completion)

    def fail(self, exc: BaseException) -> None:
        self.future.set_exception(exc)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, None)

    def done(self) -> bool:
        return self.future.done()


SLOT_TABLE_SHARE = 0.5  # of what is allocatable: the rest is for activations, the cascade's tiers, the tokenizer


def out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, or torch's allocator's RuntimeError ("can't allocate")."""
    return isinstance(exc, MemoryError) or "can't allocate memory" in str(exc) or "out of memory" in str(exc)


def fit_rows(wanted: int, bytes_per_row: int, allocatable: int) -> int:
    """How many rows of the slot table to allocate: `wanted`, or fewer when they do not fit in the share of
    `allocatable` memory a slot table may take; InsufficientMemory (one sentence) when not even one fits."""
    rows = min(wanted, int(allocatable * SLOT_TABLE_SHARE) // max(1, bytes_per_row))
    if rows < 1:
        raise InsufficientMemory(
            f"The server needs {format_bytes(bytes_per_row)} for one request's slots, more than half of the "
            f"{format_bytes(allocatable)} this process can still allocate (its memory limit included); "
            "free memory or raise the limit."
        )
    return rows


class ModelService:
    """Owns the scheduler over `backend` (a fork of its own) and the model's tokenizer. `memory_factory` is called
    as factory(backend, row), as engine.session.engine.memory_factory_for's factories take it."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        memory_factory: RowMemoryFactory | Callable[..., Memory],
        config: ServeConfig,
        draft: Backend | None = None,
        metrics: Metrics | None = None,
        vision: VisionModel | None = None,
    ) -> None:
        """`draft`: a draft model's backend (same vocabulary), for requests speculating with "draft"; each row
        drafts on a fork of its own, made when a row first needs it. `metrics`: where finished requests are counted
        (a server of several models shares one; None: this service's own). `vision`: the model's image path
        (attached to `backend`'s model), None for a model that reads text only."""
        self.config = config
        self.vision = vision
        self.draft = draft
        self.tokenizer = tokenizer
        # Does the model think, and how is it switched (its template, and think tags in its vocabulary)
        self.reasoning = reasoning_style(tokenizer.chat_template, think_tokens(tokenizer.token_to_id))
        self.memories: list[Memory] = []
        try:
            probe = memory_factory(backend, 0)  # a cascade sizes the slot table itself (batch 1); read its size off it
        except (MemoryError, RuntimeError) as exc:
            if not out_of_memory(exc):
                raise
            raise InsufficientMemory(
                "The server cannot allocate the slot table for one request in the memory this process may take "
                "(its memory limit included); free memory or raise the limit."
            ) from None
        num_slots = getattr(getattr(probe, "cfg", None), "num_slots", DEFAULT_SLOTS)
        self._lock = threading.Lock()

        def factory(view: Backend, row: int) -> Memory:
            m = memory_factory(view, row)
            with self._lock:
                self.memories.append(m)
            return m

        self.rows = fit_rows(config.max_batch, backend.slot_bytes_per_token() * (num_slots + 1), allocatable_bytes())
        sched_cfg = SchedulerConfig(max_batch=self.rows, num_slots=num_slots, max_queue=config.max_queue)
        # Beam searches run beside the scheduler on a fork of their own; the model runs one forward at a time.
        step = threading.Lock()
        beam_backend = LockedBackend(backend.fork(), step)
        beam_backend.allocate(1, num_slots)
        # Documents' capsules are read on forks of this one-row table (a cascade resizes a one-row table only).
        self.reader = LockedBackend(backend.fork(), step)
        self.reader.allocate(1, 1)
        self.beams = BeamRunner(beam_backend, tokenizer, memory_factory)
        drafts: dict[int, Backend] = {}  # row -> its draft model's slot table (kept: it follows the row's context)

        def drafter(row: int, settings: GenerationSettings) -> Drafter:
            assert draft is not None
            if row not in drafts:
                drafts[row] = LockedBackend(draft.fork(), step)
            return DraftModel(drafts[row], settings.sampling)

        try:
            self.scheduler = Scheduler(
                LockedBackend(backend, step), tokenizer, sched_cfg, factory, drafter if draft is not None else None
            )
        except (MemoryError, RuntimeError) as exc:
            if not out_of_memory(exc):
                raise
            raise InsufficientMemory(
                f"The server cannot allocate its slot table for {self.rows} request(s) of {num_slots:,} slots; "
                "free memory or raise the memory limit."
            ) from None
        self.metrics = metrics if metrics is not None else Metrics(self.gauges())

    def close(self) -> None:
        self.beams.close()
        self.scheduler.close()

    # -- requests ----------------------------------------------------------------------------------------------
    def prompt_ids(self, req: ParsedRequest) -> list[int]:
        """Prompt ids for a chat (through the chat template) or a completion (raw text, or ids as given). A chat
        with a model that reasons gets its thinking switch applied and its reply split (`req.settings.reasoning`)."""
        tok = self.tokenizer
        if req.messages is not None:
            if tok.chat_template is None:
                raise bad_request("This model has no chat template; use /v1/completions with a raw prompt.", "messages")
            style = self.reasoning
            messages, extra = chat_inputs(history(style, req.messages), req.tools, tok.chat_template)
            messages, extra = switched(style, req.settings.think, messages, extra)
            if self.vision is not None:  # a template that reads content parts gets them
                messages = template_messages(messages, tok.chat_template)
            rendered = tok.apply_chat_template(messages, **extra)
            if self.vision is not None:  # its own marks of the pictures as the engine's <image>
                rendered = self.vision.markers(rendered)
            urls = [u for m in req.messages for u in m.get("images", ())]
            ids = self._image_prompt_ids(rendered, urls) if urls else tok.encode(rendered, add_bos=False)
            inside = opens_in_prompt(rendered)
            # A grammar shapes the reply from its first token: under one, a prompt that opened a think block gets
            # no split (its constrained answer is not reasoning).
            if style.reasons and not (inside and req.settings.grammar is not None):
                req.settings = replace(req.settings, reasoning=ReasoningFormat(inside))
        elif isinstance(req.prompt, str):
            ids = tok.encode(req.prompt)
        else:
            ids = list(req.prompt or [])
            if any(t >= tok.vocab_size for t in ids):
                raise bad_request(
                    f"'prompt' holds a token id outside this model's vocabulary of {tok.vocab_size}.", "prompt"
                )
        if not ids:
            raise bad_request("The prompt is empty; send some text.", "prompt")
        if len(ids) > self.config.max_prompt_tokens:
            raise too_large(
                f"The prompt is {len(ids):,} tokens, more than the {self.config.max_prompt_tokens:,} this server accepts; shorten it.",
                "messages" if req.messages is not None else "prompt",
            )
        return ids

    def _image_prompt_ids(self, rendered: str, urls: list[str]) -> list[int]:
        """A rendered chat with pictures (data URLs, in the order of its markers) -> prompt ids."""
        if self.vision is None:
            raise bad_request("This model reads text only; send text, or serve a model that sees images.", "messages")
        remote = [u for u in urls if u.startswith(("http://", "https://"))]
        if remote and not self.config.allow_image_urls:
            raise bad_request(
                "The request has a remote image URL; send the picture inline as a data: URL (or start the server "
                "with --allow-image-urls).",
                "messages",
            )
        try:
            images = [
                fetch_image(u, f"Image {n + 1}") if u in remote else decode_base64(u, f"Image {n + 1}")
                for n, u in enumerate(urls)
            ]
            return self.vision.encode_prompt(rendered, images, add_bos=False)
        except SparkError as exc:
            raise bad_request(str(exc), "messages") from None

    async def start(self, req: ParsedRequest, documents: list[Document] | None = None) -> list[Job]:
        """Tokenize (off the event loop) and queue `req`'s `n` choices, each a request of its own (rows of one batch;
        a seeded request's choice i draws with seed + i); ApiError when it is refused (then none is queued).
        `documents`: the files `req` attaches, read from the file store (engine.openai.documents); each choice's row
        attaches them for that request only (`Job.documents` then says what its reply recalled)."""
        if req.files and documents is None:
            raise bad_request("File parts are read on /v1/chat/completions only.", "messages")
        if documents:
            check_attachable(self.memories[0] if self.memories else None)
            if len(documents) > MAX_ATTACHMENTS:
                raise bad_request(f"A request attaches at most {MAX_ATTACHMENTS} files.", "messages")
            if req.settings.beam.beams > 1:
                raise bad_request(
                    "Beam search does not attach files; send file parts without 'beam_width'.", "messages"
                )
        mode = request_speculation(req, self.config.speculative, self.draft is not None)
        req.settings = replace(req.settings, speculative=mode)
        try:
            ids = await asyncio.to_thread(self.prompt_ids, req)
        except InputTooLarge as exc:  # the request is the problem, whatever the template
            raise too_large(str(exc), "messages" if req.messages is not None else "prompt") from None
        except SparkError as exc:  # e.g. a chat template that refuses these messages
            raise bad_request(str(exc)) from None
        if req.settings.beam.beams > 1:  # one search; its best beams are the choices (engine.openai.beams)
            choices = [
                BeamChoice(Request(ids, req.settings), asyncio.get_running_loop(), self._count) for _ in range(req.n)
            ]
            self.beams.start(ids, req.settings, choices)
            return list(choices)
        jobs: list[Job] = []
        seed = req.settings.sampling.seed
        try:
            for i in range(req.n):
                settings = req.settings
                if i and seed is not None:
                    settings = replace(settings, sampling=replace(settings.sampling, seed=seed + i))
                attach = RowDocuments(documents, self.tokenizer, self.reader) if documents else None
                request = Request(ids, settings, attach=attach)
                done = self._count if attach is None else self._counter(attach)
                jobs.append(Job(self.scheduler, request, asyncio.get_running_loop(), done, attach))
        except (QueueFull, SchedulerClosed) as exc:
            for job in jobs:
                job.cancel_unless_done()
            if isinstance(exc, QueueFull):
                raise busy(self.config.retry_after_s, self.config.max_queue) from None
            raise unavailable("The server is shutting down; send the request to it again after it restarts.") from None
        return jobs

    def _count(self, c: Completion) -> None:
        self.metrics.finished(
            c.finish_reason, c.prompt_tokens, c.cached_tokens, len(c.tokens), c.ttft_s, c.tokens_per_s
        )
        if c.speculated:
            self.metrics.speculated(c.drafted_tokens, c.accepted_tokens, c.verify_forwards, c.forwards, len(c.tokens))

    def _counter(self, docs: RowDocuments) -> Callable[[Completion], None]:
        def count(c: Completion) -> None:
            self._count(c)
            self.metrics.documents(docs.document_tokens, docs.read_tokens)

        return count

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special=False)

    # -- figures -----------------------------------------------------------------------------------------------
    def gauges(self) -> dict[str, Any]:
        """Gauges for /metrics and /health: rows in use, queue, and the prefix store's hit rate."""
        out: dict[str, Any] = {
            "spark_requests_running": lambda: float(self.scheduler.running),
            "spark_requests_waiting": lambda: float(self.scheduler.waiting),
        }
        stats = getattr(self.memories[0], "stats", None) if self.memories else None
        if stats is not None:  # the persistent store is shared by every row; the other tiers are per row
            out["spark_cache_persistent_hit_ratio"] = lambda: float(stats().persistent.hit_rate)
        return out
