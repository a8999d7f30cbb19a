"""The engine's façade: `Engine` (a loaded model, weights once) and `Session` (one conversation and its memory).

The app's worker thread, the CLI and the benchmarks all talk to these two classes; nothing here imports Qt.

A turn is fed *incrementally*: the session remembers the exact text its memory holds (`known_text`); when the
rendered conversation still starts with that text, only the new suffix is tokenized and fed, so an endless
conversation keeps its cascade memory instead of being re-read every turn. When the transcript was edited (new
chat, regenerate, a template that rewrites history) the memory is reset and the prompt re-fed; the persistent
prefix cache makes that cheap.

Loading (the memory factory, the fit check, the step lock's backend wrapper) lives in engine.session.setup.

Why over ~400 lines: `Session` is the one owner of a conversation's memory, transcript, sampler and feed log;
its save and load must move all four in step (a load swaps them in only when everything checked out), so they
stay beside the state they move.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, overload

from engine.backends import BackendChoice, open_backend
from engine.backends.base import Backend
from engine.errors import InputTooLarge, SessionFileError, SparkError
from engine.fileio import FileSystem
from engine.generation.loop import (
    GenerationEvent,
    GenerationSettings,
    Pacer,
    PrefillProgress,
    controller_for,
    stream_generate,
)
from engine.generation.reasoning import (
    ReasoningFormat,
    ReasoningStyle,
    Think,
    history,
    opens_in_prompt,
    reasoning_style,
    switched,
    think_tokens,
)
from engine.generation.sampling import Sampler, SamplingSettings, make_sampler
from engine.generation.speculative import Controller, DraftModel, PromptLookup, Speculation, Speculator
from engine.hw import HardwarePolicy
from engine.hw.memory import release_code_pages
from engine.loading.model_files import check_model_path, display_name, resolve_model_path
from engine.loading.sampling_defaults import ModelSampling, model_sampling
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import Memory
from engine.memory.cascade import CascadeStats
from engine.model.kv_types import KVType
from engine.session.file import (
    RECOMPUTE_KIND,
    ForeignModelSession,
    Message,
    SessionData,
    restore,
    save_session,
)
from engine.session.kept import KeptMemory, entry_estimate, entry_state, take_snapshot
from engine.session.pictures import image_tensors
from engine.session.replay import FeedLog, backend_feed, check_schedule, memory_digest, replay
from engine.session.schema import MAX_ATTACHMENT_NAME, MAX_RECALLED, MAX_RECALLED_TEXT
from engine.session.setup import (
    LockedBackend,
    MemoryFactory,
    TokenCounter,
    check_fits,
    memory_factory_for,
    seeing_pictures,
)
from engine.session.types import AttachmentRecord, RecalledRecord
from engine.tools.calls import ChatEvent, ToolChoice, ToolSpec, finish_with_calls, read_reply
from engine.tools.grammar import tool_settings
from engine.tools.template import TOOL_ROLE, transcript_inputs
from engine.vision.gguf_vision import attach_mmproj, find_mmproj
from engine.vision.idefics3 import IMAGE_TOKEN
from engine.vision.images import DecodedImage
from engine.vision.messages import template_messages
from engine.vision.model import ImageInputError, attach_vision, backends_passed_over

# Joins a session file's recorded attachment to the memory being restored (engine.documents.attach.Reattacher):
# `present` when the memory's state already holds its blocks (a full file), else it adopts them (a compact replay).
Reattach = Callable[[Memory, AttachmentRecord, bool], None]

MAX_PROMPT_CHARS = 1_000_000  # ~250k tokens: anything larger is a mistake (a pasted file), not a prompt

__all__ = [
    "ChatMessage",
    "Engine",
    "LoadReport",
    "MemoryFactory",
    "Session",
    "memory_factory_for",
]  # the last two from engine.session.setup


@dataclass(frozen=True)
class LoadReport:
    """What `Session.load` did, in words the UI and CLI can show."""

    applied: bool  # False: nothing changed (a foreign file not accepted as transcript-only)
    foreign_model: bool  # the file was made with another model or tokenizer
    transcript_only: bool  # messages restored, memory re-read on the next turn instead of restored
    messages: int
    tokens: int
    message: str


@dataclass
class ChatMessage:
    role: str  # "system" | "user" | "assistant" | "tool" (a tool's result: Session.tool_results)
    content: str  # an assistant's answer, without its thinking
    timestamp: float = field(default_factory=time.time)
    reasoning: str = ""  # an assistant's think block (engine.generation.reasoning), kept apart from the answer

    def as_template_dict(self) -> dict[str, str]:
        if self.reasoning:  # OpenAI-style (llama.cpp, vLLM): templates that want earlier thinking read this key
            return {"role": self.role, "content": self.content, "reasoning_content": self.reasoning}
        return {"role": self.role, "content": self.content}


class Engine:
    """A loaded model on one backend; conversations are opened from it and share its weights."""

    def __init__(
        self,
        choice: BackendChoice,
        tokenizer: Tokenizer,
        model_dir: Path,
        memory_factory: MemoryFactory,
        policy: HardwarePolicy | None = None,
        draft: Backend | None = None,
        mmproj: Path | None = None,
    ) -> None:
        self.policy = policy  # paces every session's generation (thermal throttling / pause) unless given another
        self.choice = choice
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.memory_factory = memory_factory
        self._first_taken = False
        # One forward at a time on shared weights: conversations on other threads queue per step, so the quick
        # prompt interleaves with a running chat token by token instead of waiting for the whole reply.
        self.step_lock = threading.Lock()
        self.draft = draft  # the draft model's backend (speculative decoding), when one was loaded
        self.mmproj = mmproj  # a GGUF model's projector file (engine.vision.gguf_vision), or None
        # None: the model reads text only
        self.vision = (
            attach_mmproj(mmproj, tokenizer, choice.backend)
            if mmproj is not None
            else attach_vision(model_dir, tokenizer, choice.backend)
        )
        if self.vision is not None:  # its memories keep each picture a unit (engine.memory.cascade.pictures)
            self.memory_factory = seeing_pictures(
                memory_factory, self.vision.picture_token, self.vision.max_picture_tokens
            )

    @classmethod
    def load(
        cls,
        model_dir: str | Path | None = None,
        backend: str = "auto",
        *,
        memory_factory: MemoryFactory,
        policy: HardwarePolicy | None = None,
        quantize: str = "none",
        draft_model: str | Path | None = None,
        draft_quantize: str = "auto",
        kv_type: KVType = KVType.F16,
        mmproj: str | Path | None = None,
    ) -> Engine:
        """Load a model (HF folder or GGUF; the default model when None); with a `policy`, refuse (one sentence) a
        model this machine cannot hold, by the loaded backend's own figures. `draft_model`: a smaller model with the
        same vocabulary, loaded on the same backend kind, for speculative decoding (`Speculation.DRAFT`). `mmproj`:
        a GGUF model's llama.cpp projector file (else the one beside it, if one)."""
        # The code that only ran while importing (torch's operator registrations) gives its pages back before the
        # weights come in, and the loader's own code after: the process holds the model, not its start-up.
        release_code_pages()
        model_dir = resolve_model_path(model_dir)
        check_model_path(model_dir)
        projector = find_mmproj(model_dir, Path(mmproj) if mmproj is not None else None)
        tokenizer = Tokenizer.load(model_dir)
        passed_over = backends_passed_over(model_dir, projector)  # a model that sees images: not Core ML or MLX
        choice = open_backend(model_dir, backend, quantize, kv_type=kv_type, passed_over=passed_over)
        if policy is not None:
            check_fits(policy, choice.backend, model_dir)
        draft = None
        if draft_model is not None:
            draft_dir = resolve_model_path(draft_model)
            check_model_path(draft_dir)
            check_same_vocabulary(tokenizer, Tokenizer.load(draft_dir))
            draft = open_backend(draft_dir, choice.backend.name, draft_quantize).backend
        release_code_pages()
        return cls(choice, tokenizer, model_dir, memory_factory, policy, draft, projector)

    @property
    def backend(self) -> Backend:
        return self.choice.backend

    @functools.cached_property
    def reasoning(self) -> ReasoningStyle:
        """Whether the model thinks before it answers and how that is switched, from its chat template."""
        return reasoning_style(self.tokenizer.chat_template, think_tokens(self.tokenizer.token_to_id))

    @functools.cached_property
    def sampling_defaults(self) -> ModelSampling:
        """The model's own recommended sampling (its GGUF keys, generation_config.json or the catalog, with a loop
        guard for small models): what the app shows as "the model's defaults", each conversation may override."""
        return model_sampling(self.model_dir)

    def default_settings(self, seed: int | None = None) -> GenerationSettings:
        """Generation settings at the model's own defaults."""
        m = self.sampling_defaults
        sampling = SamplingSettings.from_model(m, seed)
        if m.max_tokens is None:
            return GenerationSettings(sampling=sampling)
        return GenerationSettings(max_tokens=m.max_tokens, sampling=sampling)

    def locked_fork(self) -> Backend:
        """A fork of the backend (its own slot table, shared weights) whose forwards take the step lock: for a
        scheduler serving requests beside this engine's conversations."""
        return LockedBackend(self.backend.fork(), self.step_lock)

    def new_session(self) -> Session:
        """The first session uses the loaded backend's slot table; later ones fork their own."""
        backend = self.backend if not self._first_taken else self.backend.fork()
        self._first_taken = True
        return Session(self, backend, self.memory_factory(backend))


def load(
    model: str | Path | None = None,
    backend: str = "auto",
    *,
    quantize: str = "none",
    cache_dir: Path | None = None,
    prefix_cache: bool = True,
    policy: HardwarePolicy | None = None,
    kv_type: KVType = KVType.F16,
    mmproj: str | Path | None = None,
) -> Engine:
    """The engine's front door: a model (HF folder, GGUF file, or the default model when None) on `backend`, each
    conversation's memory the cascade over a persistent prefix cache under `cache_dir` (the app's cache dir when
    None). With a `policy`, a model this machine cannot hold is refused in one sentence. `mmproj`: a GGUF model's
    projector file, when it is not the one beside the model."""
    factory = memory_factory_for(model, cache_dir=cache_dir, prefix_cache=prefix_cache, policy=policy)
    return Engine.load(
        model, backend, memory_factory=factory, policy=policy, quantize=quantize, kv_type=kv_type, mmproj=mmproj
    )


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer) -> None:
    """SparkError (one sentence) unless the draft model's tokens are the target's, id for id."""
    n = target.vocab_size
    if draft.vocab_size != n or any(target.id_to_token(i) != draft.id_to_token(i) for i in range(n)):
        raise SparkError("The draft model has another vocabulary than the model; choose one of the same family.")


class Session:
    """One conversation: messages, its memory on its own slot table, the sampler, and the unfed last token."""

    def __init__(self, engine: Engine, backend: Backend, memory: Memory) -> None:
        self.engine = engine
        self.backend = backend
        self.memory = memory
        self.tokenizer = engine.tokenizer
        self.messages: list[ChatMessage] = []
        self.system_prompt = ""
        self.pending_token: int | None = None  # sampled last, not yet fed (fed first on the next turn)
        self.known_text = ""  # decoded text of memory.tokens + pending_token, special tokens included
        self.sampler = make_sampler(SamplingSettings())  # its .settings are this conversation's sampling settings
        self.feed_log = FeedLog()  # how memory was fed since its last reset (a compact save's recipe)
        self.restore_digest_ok: bool | None = None  # after a compact restore: was the rebuilt memory bit-identical?
        self.memory_source = "new"  # where the memory came from: "new", "kept" (read back), "recomputed", "file"
        self.computed = TokenCounter()  # tokens this session's forwards computed (replays included)
        self.on_prefill: Callable[[PrefillProgress], None] | None = None  # hears the reading of each prompt
        self.images: list[DecodedImage] = []  # the transcript's pictures, in the order of its <image> markers
        # The tools the last turn offered (engine.tools): described in the prompt, their calls read back; the
        # transcript's earlier calls and results render through engine.tools.template whether or not any are offered.
        self.tools: ToolSpec | None = None
        # Documents and earlier conversations the memory holds (engine.documents), as a session file records them.
        self.attachments: list[AttachmentRecord] = []
        self.recalled: list[RecalledRecord] = []  # passages replies drew on, kept with the transcript
        self._draft_backend: Backend | None = None  # the draft model's slot table for this conversation
        # Adaptive controllers by drafter (auto shares lookup's): measured costs and acceptance, turn after turn.
        self.controllers = {Speculation.LOOKUP: Controller(), Speculation.DRAFT: Controller()}

    # -- conversation ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """New chat: forget messages and memory."""
        self.messages = []
        self.images = []
        self.recalled = []
        self._reset_memory()
        self.feed_log.clear()
        self.pending_token = None
        self.known_text = ""
        self.sampler = make_sampler(self.sampler.settings)  # a new chat restarts a seeded stream

    @overload
    def chat(
        self,
        user_text: str,
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = ...,
        pacer: Pacer | None = ...,
        images: Sequence[DecodedImage] = ...,
        *,
        tools: None = None,
    ) -> Iterator[GenerationEvent]: ...

    @overload
    def chat(
        self,
        user_text: str,
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = ...,
        pacer: Pacer | None = ...,
        images: Sequence[DecodedImage] = ...,
        *,
        tools: ToolSpec | None,
    ) -> Iterator[ChatEvent]: ...

    def chat(
        self,
        user_text: str,
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = lambda: False,
        pacer: Pacer | None = None,
        images: Sequence[DecodedImage] = (),
        *,
        tools: ToolSpec | None = None,
    ) -> Iterator[GenerationEvent] | Iterator[ChatEvent]:
        """Append a user message and stream the assistant's reply (appended to `messages` when it ends).
        `images`: pictures the message is about, placed where its text says `<image>` (else before the text).
        `tools`: the tools this turn offers, under their grammar (engine.tools; kept in `tools` for later renders of
        the transcript; None: none); a reply that calls them ends in FinishReason.TOOL_CALLS and a ToolCalls event,
        and `tool_results` hands their results back."""
        self._check_size(user_text)
        user_text = self._place_images(user_text, images)
        self.messages.append(ChatMessage("user", user_text))
        return self._answer(settings, should_stop, pacer, tools)

    def tool_results(
        self,
        results: Sequence[str],
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = lambda: False,
        pacer: Pacer | None = None,
        *,
        choice: ToolChoice = ToolChoice.AUTO,
    ) -> Iterator[ChatEvent]:
        """Continue a reply that ended in tool calls: `results` are the `tool` messages' contents, in the order of
        the calls (the caller's own form: the transcript, and so the `.spark` file, keeps them as given); the reply
        goes on offering the same tools, as `choice` says (`auto` by default: a forced choice would call again)."""
        if self.tools is None or not self.messages or self.messages[-1].role not in ("assistant", TOOL_ROLE):
            raise SparkError("There are no tool calls to answer; offer tools to a reply first.")
        if not results:
            raise SparkError("There are no tool results to hand back; give one per call.")
        now = time.time()
        self.messages += [ChatMessage(TOOL_ROLE, content, now) for content in results]
        return self._answer(settings, should_stop, pacer, replace(self.tools, choice=choice))

    def submit(
        self,
        messages: Sequence[ChatMessage | dict[str, str]],
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = lambda: False,
        pacer: Pacer | None = None,
    ) -> Iterator[GenerationEvent]:
        """Stream a reply to `messages` (the whole conversation so far, last one from the user)."""
        msgs = [
            m
            if isinstance(m, ChatMessage)
            else ChatMessage(m["role"], m["content"], reasoning=m.get("reasoning_content", ""))
            for m in messages
        ]
        if self.messages is not messages:
            self.messages = list(msgs)
        rendered = self._render(add_generation_prompt=True, think=settings.think)
        self._check_size(rendered)  # what the template made of the text, not only what was typed
        ids = self._ids_for_text(rendered)
        return self._run(ids, self._split(settings, rendered), should_stop, pacer, reply_to_messages=True)

    def read_transcript(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Bring memory in step with `messages` without replying (a branch): feeds what memory does not hold yet."""
        if not self.messages:
            return
        rendered = self._render(add_generation_prompt=False)
        ids = self._ids_for_text(rendered)
        if ids:
            for _ in self._run(ids, GenerationSettings(max_tokens=0), should_stop, None, reply_to_messages=False):
                pass

    @overload
    def regenerate(
        self,
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = ...,
        pacer: Pacer | None = ...,
        *,
        tools: None = None,
    ) -> Iterator[GenerationEvent]: ...

    @overload
    def regenerate(
        self,
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = ...,
        pacer: Pacer | None = ...,
        *,
        tools: ToolSpec | None,
    ) -> Iterator[ChatEvent]: ...

    def regenerate(
        self,
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = lambda: False,
        pacer: Pacer | None = None,
        *,
        tools: ToolSpec | None = None,
    ) -> Iterator[GenerationEvent] | Iterator[ChatEvent]:
        """Drop the last reply (its tool calls and results included) and answer the last user message again."""
        while self.messages and self.messages[-1].role in ("assistant", TOOL_ROLE):
            self.messages.pop()
        return self._answer(settings, should_stop, pacer, tools)

    def complete(
        self,
        prompt: str,
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = lambda: False,
        pacer: Pacer | None = None,
        images: Sequence[DecodedImage] = (),
    ) -> Iterator[GenerationEvent]:
        """Raw completion: the prompt text as is (BOS where the tokenizer adds one), appended to what came before.
        `images`: as chat's."""
        self._check_size(prompt)
        prompt = self._place_images(prompt, images)
        if not self.memory.tokens and self.pending_token is None:
            ids = self._encode(prompt)
            self.known_text = prompt if IMAGE_TOKEN in prompt else self.tokenizer.decode(ids, skip_special=False)
        else:
            ids = self._pending() + self._encode(prompt, add_bos=False)
            self.known_text += prompt
        return self._run(ids, settings, should_stop, pacer, reply_to_messages=False)

    def complete_ids(
        self,
        ids: Sequence[int],
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = lambda: False,
        pacer: Pacer | None = None,
    ) -> Iterator[GenerationEvent]:
        """Raw completion from token ids (benchmarks, batch jobs), appended to what came before."""
        ids = self._pending() + list(ids)
        self.known_text += self.tokenizer.decode(ids[len(self._pending()) :], skip_special=False)
        return self._run(ids, settings, should_stop, pacer, reply_to_messages=False)

    def continue_reply(
        self, settings: GenerationSettings, should_stop: Callable[[], bool] = lambda: False, pacer: Pacer | None = None
    ) -> Iterator[GenerationEvent]:
        """Extend the last reply: feed the unfed last token and keep sampling (N then M tokens == N+M in one run)."""
        if self.pending_token is None:
            raise InputTooLarge("There is no reply to continue; send a prompt first.")
        extend = bool(self.messages) and self.messages[-1].role == "assistant"
        if extend:  # a reply cut short inside its thinking goes on thinking
            settings = self._split(settings, self.known_text)
        return self._run(self._pending(), settings, should_stop, pacer, reply_to_messages=extend, extend_last=extend)

    # -- files ------------------------------------------------------------------------------------------------
    def save(self, path: str | Path, *, compact: bool = False, compression: str = "zlib", digest: bool = True) -> int:
        """Write the conversation and its memory to a .spark file (atomically); returns its size in bytes.

        `compact`: keep the transcript, token ids and the feed recipe instead of the KV (engine.session.replay); the memory
        is recomputed on open. When the recipe is not known (a memory restored from an older full file), the full
        memory is written instead. `digest` (compact only): keep a hash of the memory so a restore can say whether
        the rebuilt one is bit-identical; hashing the whole slot table takes a while, so a save in a hurry (Quit)
        goes without.
        """
        extra: dict[str, Any] = {"known_text": self.known_text, "model": display_name(self.engine.model_dir)}
        order, pictures = image_tensors(self.images)  # each picture once, by its hash
        if order:
            extra["images"] = order
        schedule = self.feed_log.schedule_for(len(self.memory.tokens))
        token_ids = list(self.memory.tokens)
        if schedule is not None:
            extra["feed_schedule"] = schedule  # kept in full files too, so they can be re-saved compact
        if self.attachments:
            extra["attachments"] = [a.to_json() for a in self.attachments]
        recalled = recalled_to_keep(self.recalled, len(self.messages))
        if recalled:
            extra["recalled"] = recalled
        recompute = compact and schedule is not None
        if recompute:
            extra["recompute"] = {"version": 1, "digest": memory_digest(self.memory)} if digest else {"version": 1}
        # A compact file holds no KV: the memory's state is copied out only for a full one.
        meta, tensors = ({"kind": RECOMPUTE_KIND}, {}) if recompute else self.memory.state()
        return save_session(
            path,
            fingerprint=self.backend.fingerprint,
            tokenizer_hash=self.tokenizer.content_hash,
            messages=[Message(m.role, m.content, m.timestamp, m.reasoning) for m in self.messages],
            system_prompt=self.system_prompt,
            settings={"sampling": asdict(self.sampler.settings)},
            memory_state=(meta, {**tensors, **pictures}),
            pending_token=self.pending_token,
            sampler_state=self.sampler.get_state(),
            extra=extra,
            token_ids=token_ids,
            compression=compression,
            kv_type=self.backend.kv_type.value,
        )

    def keep(self, kept: KeptMemory, conversation: Path, *, later: bool = False) -> bool:
        """Keep this conversation's whole memory on disk for `conversation` (its compact file), so reopening it
        reads instead of recomputing (engine.session.kept); False when nothing was kept (no memory, over budget).
        With `later`, a snapshot (a copy of the state) is taken now and written by the kept memory's background
        writer: True once queued."""
        if not self.memory.tokens:
            kept.discard(conversation)
            return False
        snap = take_snapshot(self.memory)  # the blocks still paged in a kept file are read by the writer
        meta = copy.deepcopy(snap.meta)
        extra: dict[str, Any] = {"numerics": self.backend.numerics}
        fingerprint, tokenizer_hash = self.backend.fingerprint, self.tokenizer.content_hash
        kv_type, pending, token_ids = self.backend.kv_type.value, self.pending_token, list(self.memory.tokens)

        def write(path: Path, fs: FileSystem) -> int:
            tensors, digests = entry_state(meta, snap.tensors, snap.paged)
            return save_session(
                path,
                fingerprint=fingerprint,
                tokenizer_hash=tokenizer_hash,
                messages=[],  # the compact file holds the transcript; this entry only the memory
                system_prompt=None,
                settings={},
                memory_state=(meta, tensors),
                pending_token=pending,
                sampler_state=None,
                extra={**extra, "kept": digests},  # so it can be read in part (engine.session.kept)
                token_ids=token_ids,
                compression="none",  # read back at the speed of a copy, and by offset
                kv_type=kv_type,
                fs=fs,
            )

        estimate = entry_estimate(snap.bytes, len(token_ids))
        if later:
            return kept.write_later(conversation, estimate, write)
        return kept.write(conversation, estimate, write)

    def load(
        self,
        path: str | Path,
        *,
        accept_transcript_only: bool = False,
        on_progress: Callable[[int, int], None] | None = None,
        kept: KeptMemory | None = None,
        reattach: Reattach | None = None,
    ) -> LoadReport:
        """Restore a .spark file into this session, or leave it untouched on any error.

        The memory is restored into a fresh slot table and swapped in only when everything checked out. A file
        from another model changes nothing unless `accept_transcript_only`, in which case its messages come back
        and are re-read on the next turn. A compact file's memory is read back from `kept` when an entry there
        matches it exactly (engine.session.kept), else recomputed.

        A file whose memory holds attachments needs `reattach`: they join the memory again from the persistent store,
        where they joined it (a compact file's replay) or as the restored state holds them (a full file); one not
        found there fails the load in one sentence naming it.
        """
        fork = self.backend.fork()
        digest_ok: list[bool] = []
        sources: list[str] = []
        joined: list[bool] = []  # the compact replay attached them as it went

        def attach_at(memory: Memory, records: list[AttachmentRecord]) -> Callable[[int], None]:
            waiting = sorted(records, key=lambda a: a.at)

            def before(at: int) -> None:
                while waiting and waiting[0].at <= at:
                    if waiting[0].at < at or reattach is None:
                        raise SessionFileError(
                            f"The session {Path(path).name}'s attachments do not fit its memory's recipe."
                        )
                    reattach(memory, waiting.pop(0), False)

            return before

        def recompute(memory: Memory, data: SessionData) -> None:
            # A compact file: feed its tokens again exactly as they were fed (see engine.session.replay), then compare.
            self._check_image_ids(path, data)  # its pictures' ids embed again as they did
            schedule = check_schedule(data.extra.get("feed_schedule"), len(data.token_ids))
            if kept is not None and kept.read_into(Path(path), data, memory, fork):
                sources.append("kept")  # read back as it was when the conversation was left: nothing to compute
                return
            sources.append("recomputed")
            runner = LockedBackend(fork, self.engine.step_lock, counter=self.computed)
            before = attach_at(memory, data.attachments) if data.attachments else None
            replay(backend_feed(runner, memory), memory, data.token_ids, schedule, on_progress, before)
            joined.append(True)
            saved = data.extra.get("recompute")
            if not isinstance(saved, dict) or "digest" in saved:  # saved without one: nothing to compare
                digest_ok.append(isinstance(saved, dict) and saved.get("digest") == memory_digest(memory))

        outcome = restore(
            path, fork, self.engine.memory_factory, tokenizer_hash=self.tokenizer.content_hash, recompute=recompute
        )
        data = outcome.data
        messages = [ChatMessage(m.role, m.content, m.timestamp or time.time(), m.reasoning) for m in data.messages]
        if isinstance(outcome, ForeignModelSession):
            if not accept_transcript_only:
                return LoadReport(False, True, False, len(messages), 0, outcome.reason)
            self.reset()
            self.messages, self.system_prompt = messages, data.system_prompt or ""
            self.recalled = list(data.recalled)
            self.images = list(data.images) if self.engine.vision is not None else []
            return LoadReport(
                True,
                True,
                True,
                len(messages),
                0,
                f"{outcome.reason} Restored {len(messages)} messages; the memory will be re-read.",
            )
        if data.memory_meta.get("kind") != RECOMPUTE_KIND:
            try:
                self._check_image_ids(path, data)
            except SparkError:
                outcome.memory.reset()
                raise
        if data.attachments and not joined:  # a full file, or read back from the kept memory: the blocks are there
            if reattach is None:
                raise SessionFileError(
                    f"The session {Path(path).name} holds attached documents; open it with the engine's attachments."
                )
            try:
                for record in data.attachments:
                    reattach(outcome.memory, record, True)
            except BaseException:
                outcome.memory.reset()
                raise
        self.backend, self.memory = fork, outcome.memory
        self.images = list(data.images)
        self.attachments[:] = data.attachments
        self.restore_digest_ok = digest_ok[0] if digest_ok else None
        self.memory_source = sources[0] if sources else "file"
        try:
            self.feed_log.adopt(
                check_schedule(data.extra.get("feed_schedule"), len(self.memory.tokens)), len(self.memory.tokens)
            )
        except SparkError:
            self.feed_log.clear()
            self.feed_log.valid = False  # recipe unknown: later compact saves keep the full memory
        self.messages, self.system_prompt = messages, data.system_prompt or ""
        self.recalled = list(data.recalled)
        self.pending_token = data.pending_token
        self.known_text = str(data.extra.get("known_text", ""))
        sampling = data.settings.get("sampling")
        if isinstance(sampling, dict):
            try:
                self.sampler = make_sampler(SamplingSettings(**sampling))
                if data.sampler_state is not None:
                    self.sampler.set_state(data.sampler_state)
            except (TypeError, ValueError, SparkError):
                self.sampler = make_sampler(SamplingSettings())  # unusable settings: fresh sampler, memory still exact
        n = len(self.memory.tokens)
        how = (
            " (read back from the kept memory)"
            if self.memory_source == "kept"
            else ""
            if self.restore_digest_ok is None
            else " (recomputed, identical)"
            if self.restore_digest_ok
            else " (recomputed; it differs slightly from the saved one, as on other numerics)"
        )
        return LoadReport(
            True, False, False, len(messages), n, f"Restored {len(messages)} messages and {n:,} tokens of memory{how}."
        )

    def _check_image_ids(self, path: str | Path, data: SessionData) -> None:
        """A file's pictures registered with this model's vision tower, and every id above the vocabulary in its
        tokens one of theirs; else one sentence, nothing applied. (A text model's vocabulary check refused such ids.)"""
        vision = self.engine.vision
        if vision is None:
            return
        fed = data.memory_meta.get("tokens")
        tokens = [*data.token_ids, *(fed if isinstance(fed, list) else [])]
        above = {t for t in tokens if isinstance(t, int) and t >= vision.vocab_size}
        name = Path(path).name
        try:
            ids = vision.register(data.images) if data.images else set()
        except ImageInputError as exc:
            raise SessionFileError(f"The session file {name} cannot be restored here: {exc}") from None
        if not above <= ids:
            raise SessionFileError(
                f"The session file {name} holds picture tokens that none of its pictures gives on this model; "
                "nothing was restored."
            )

    def stats(self) -> CascadeStats | None:
        """The memory's tier statistics (CascadeStats), or None for a memory without tiers."""
        stats = getattr(self.memory, "stats", None)
        return stats() if stats else None

    # -- internals ---------------------------------------------------------------------------------------------
    def _template_messages(self) -> list[dict[str, str]]:
        msgs = [m.as_template_dict() for m in self.messages]
        if self.system_prompt and not (msgs and msgs[0]["role"] == "system"):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def _render(self, add_generation_prompt: bool, think: Think = Think.AUTO) -> str:
        style = self.engine.reasoning
        messages = history(style, self._template_messages())  # earlier thinking only where the template reads it
        if self.engine.vision is not None:  # a template that reads content parts gets them
            messages = template_messages(messages, self.tokenizer.chat_template)
        if self.tools is not None or any(m["role"] == TOOL_ROLE for m in messages):
            msgs, extra = transcript_inputs(messages, self.tools, self.tokenizer.chat_template)
        else:
            msgs, extra = list(messages), {}
        msgs, extra = switched(style, think, msgs, extra)
        rendered = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **extra)
        # The template's own image marker (Gemma 3's <start_of_image>) as the engine's <image>.
        return rendered if self.engine.vision is None else self.engine.vision.markers(rendered)

    def _answer(
        self,
        settings: GenerationSettings,
        should_stop: Callable[[], bool],
        pacer: Pacer | None,
        tools: ToolSpec | None,
    ) -> Iterator[GenerationEvent] | Iterator[ChatEvent]:
        """Stream a reply to the transcript offering `tools` (kept for later renders of it; None: none)."""
        self.tools = tools
        if tools is None or not tools.active:
            return self.submit(self.messages, settings, should_stop, pacer)
        events = self.submit(
            self.messages, tool_settings(settings, tools, self.engine.reasoning.reasons), should_stop, pacer
        )
        return self._read_calls(events, tools)

    @staticmethod
    def _read_calls(events: Iterator[GenerationEvent], spec: ToolSpec) -> Iterator[ChatEvent]:
        """The reply's events, its calls read back once it has ended (and the transcript holds it): when it made
        calls a ToolCalls event follows its final event, which then ends in FinishReason.TOOL_CALLS if the reply
        ended by itself (one cut at max_tokens keeps LENGTH; its complete calls still come)."""
        text: list[str] = []
        final: GenerationEvent | None = None
        for ev in events:
            text.append(ev.text)
            if ev.finish_reason is None:
                yield ev
            else:
                final = ev
        if final is None or final.finish_reason is None:
            return
        reply = read_reply("".join(text), spec)
        yield replace(final, finish_reason=finish_with_calls(final.finish_reason, bool(reply.calls)))
        if reply.calls:
            yield reply

    def _split(self, settings: GenerationSettings, rendered: str) -> GenerationSettings:
        """`settings` with the reply's split into reasoning and answer, for a model that reasons."""
        if not self.engine.reasoning.reasons or settings.reasoning is not None:
            return settings
        return replace(settings, reasoning=ReasoningFormat(inside=opens_in_prompt(rendered)))

    def drop_recipe(self) -> None:
        """The memory changed in a way its feed recipe cannot replay (an attachment removed after tokens were
        computed, engine.documents.attach): compact saves keep the full memory until the memory is next reset."""
        self.feed_log.valid = False

    def _reset_memory(self) -> None:
        """Forget the memory's tokens; its attachments stay, adopted again from its first token on."""
        self.memory.reset()
        self.attachments[:] = [replace(a, at=0) for a in self.attachments]  # in place: Attachments records into it

    def _pending(self) -> list[int]:
        return [self.pending_token] if self.pending_token is not None else []

    def _ids_for_text(self, rendered: str) -> list[int]:
        """Ids to feed so that memory holds `rendered`: only the new suffix when memory already holds a prefix."""
        if self.known_text and rendered.startswith(self.known_text):
            suffix = rendered[len(self.known_text) :]
            self.known_text = rendered
            return self._pending() + self._encode(suffix, add_bos=False)
        self._reset_memory()
        self.feed_log.clear()
        self.pending_token = None
        ids = self._encode(rendered, add_bos=False) if self._template_has_bos(rendered) else self._encode(rendered)
        # A picture's ids decode to nothing: memory then holds the rendered text, its <image> markers included.
        self.known_text = rendered if self._has_images(rendered) else self.tokenizer.decode(ids, skip_special=False)
        return ids

    def _place_images(self, text: str, images: Sequence[DecodedImage]) -> str:
        """`text` with one <image> marker per picture (before the text unless it places them), the pictures kept."""
        if not images:
            if self._has_images(text):
                raise ImageInputError(f"The text holds {IMAGE_TOKEN}, which marks where a picture goes; attach one.")
            return text
        if self.engine.vision is None:
            raise ImageInputError(
                f"{display_name(self.engine.model_dir)} reads text only; choose a model that sees images (SmolVLM, Gemma 3)."
            )
        marked = text if text.count(IMAGE_TOKEN) == len(images) else IMAGE_TOKEN * len(images) + text
        if marked.count(IMAGE_TOKEN) != len(images):
            raise ImageInputError(f"The text places {text.count(IMAGE_TOKEN)} images but {len(images)} were given.")
        self.images.extend(images)
        return marked

    def _has_images(self, text: str) -> bool:
        return self.engine.vision is not None and IMAGE_TOKEN in text

    def _encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; on a model that sees images, its <image> markers are the last pictures given."""
        vision = self.engine.vision
        if vision is None or IMAGE_TOKEN not in text:
            return self.tokenizer.encode(text, add_bos=add_bos)
        n = text.count(IMAGE_TOKEN)
        if n > len(self.images):
            raise ImageInputError(f"The text places {n} images but the conversation holds {len(self.images)}.")
        return vision.encode_prompt(text, self.images[len(self.images) - n :], add_bos=add_bos)

    def _template_has_bos(self, rendered: str) -> bool:
        bos = self.tokenizer.bos_id
        return bos is not None and rendered.startswith(self.tokenizer.decode([bos], skip_special=False))

    def _check_size(self, text: str) -> None:
        if len(text) > MAX_PROMPT_CHARS:
            raise InputTooLarge(
                f"The prompt is {len(text):,} characters, more than the {MAX_PROMPT_CHARS:,} MLoT Spark accepts; shorten it or attach less."
            )

    def _sampler_for(self, s: SamplingSettings) -> Sampler:
        # Keep one sampler (and its RNG stream) across turns while settings are unchanged, so a seeded run that is
        # saved and continued draws the same numbers as an uninterrupted one.
        if asdict(s) != asdict(self.sampler.settings):
            self.sampler = make_sampler(s)
        return self.sampler

    def _speculator_for(self, settings: GenerationSettings) -> Speculator | None:
        """The speculator of this turn: draft speculation's (the draft model's own slot table, made once per
        session), or prompt lookup's, each with the session's adaptive controller for its drafter (what it measured
        carries over from turn to turn, so a machine where verifying does not pay stops paying for the
        measurement); None when off."""
        mode = Speculation(settings.speculative)
        if mode is Speculation.OFF:
            return None
        drafter = Speculation.DRAFT if mode is Speculation.DRAFT else Speculation.LOOKUP
        controller = self.controllers[drafter] if settings.draft_tokens == 0 else controller_for(settings)
        if mode is not Speculation.DRAFT:
            return Speculator(PromptLookup(), controller)
        if self.engine.draft is None:
            raise SparkError("Draft speculation needs a draft model; load one with --draft-model.")
        if self._draft_backend is None:
            self._draft_backend = LockedBackend(self.engine.draft.fork(), self.engine.step_lock)
        return Speculator(DraftModel(self._draft_backend, settings.sampling), controller)

    def _run(
        self,
        ids: list[int],
        settings: GenerationSettings,
        should_stop: Callable[[], bool],
        pacer: Pacer | None,
        *,
        reply_to_messages: bool,
        extend_last: bool = False,
    ) -> Iterator[GenerationEvent]:
        if not ids:
            raise InputTooLarge("There is nothing to send; type a prompt first.")
        sampler = self._sampler_for(settings.sampling)
        policy = self.engine.policy
        spill = getattr(self.memory, "spill", None)
        if policy is not None and spill is not None and policy.under_pressure():
            spill()  # in this conversation's own thread, between turns: no other thread touches its memory
        tokens: list[int] = []
        reply = ""
        held_before = len(self.memory.tokens)
        if reply_to_messages and not extend_last:
            self.messages.append(ChatMessage("assistant", ""))
        self.pending_token = None
        try:
            pacer = pacer or self.engine.policy
            runner = LockedBackend(self.backend, self.engine.step_lock, self.feed_log, self.memory, self.computed)
            gen = stream_generate(
                runner,
                self.memory,
                self.tokenizer,
                ids,
                settings,
                sampler=sampler,
                should_stop=should_stop,
                pacer=pacer,
                on_prefill=self.on_prefill,
                speculator=self._speculator_for(settings),
            )
            for ev in gen:
                if ev.token is not None:
                    tokens.append(ev.token)
                    self.pending_token = ev.token
                reply += ev.text
                if reply_to_messages:
                    self.messages[-1].content += ev.text
                    self.messages[-1].reasoning += ev.reasoning
                yield ev
        finally:
            if settings.beam.beams > 1:  # the beams' forks ran forwards the feed log cannot attribute
                self.feed_log.valid = False  # recipe unknown: later compact saves keep the full memory
            # Whatever was sampled (even on cancel) is now part of the conversation's known text.
            self.known_text += self.tokenizer.decode(tokens, skip_special=False)
            if not tokens and len(self.memory.tokens) < held_before + len(ids):
                # Stopped while the prompt was read: memory holds part of it; say exactly what it holds, so the
                # next turn feeds the rest (or re-reads, when the partial text is not a clean prefix).
                self.known_text = self.tokenizer.decode(list(self.memory.tokens), skip_special=False)
                self.pending_token = None
            last = self.messages[-1] if reply_to_messages and not extend_last else None
            if last is not None and not last.content and not last.reasoning and not tokens:
                self.messages.pop()


def recalled_to_keep(recalled: list[RecalledRecord], messages: int) -> list[dict[str, Any]]:
    """The passages a file keeps: under messages it holds, the newest MAX_RECALLED, each within what its schema
    accepts (a long name or text cut), so saving never writes a file that its own load would refuse."""
    out = []
    for r in recalled:
        if 0 <= r.message < messages and r.source and 0 <= r.start <= r.end and (r.page is None or r.page > 0):
            out.append(replace(r, source=r.source[:MAX_ATTACHMENT_NAME], text=r.text[:MAX_RECALLED_TEXT]).to_json())
    return out[-MAX_RECALLED:]
