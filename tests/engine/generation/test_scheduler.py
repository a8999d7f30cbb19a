"""Continuous batching: same tokens as running alone, cancellation, priorities under a full queue, async face."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import Future

import pytest

from engine.backends.torch_backend import TorchBackend
from engine.errors import InputTooLarge
from engine.generation.loop import GenerationEvent, GenerationSettings, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.generation.scheduler import Priority, QueueFull, Request, Scheduler, SchedulerConfig
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory
from tests.helpers.fixtures import TinyModel

GREEDY = SamplingSettings(greedy=True)
TEXT = "The quick brown fox jumps over the lazy dog. Python is a programming language. def main(): return 42"


def settings(n: int, chunk: int = 4) -> GenerationSettings:
    return GenerationSettings(max_tokens=n, sampling=GREEDY, prefill_chunk=chunk)


def alone(backend: TorchBackend, tok: Tokenizer, ids: list[int], s: GenerationSettings) -> list[int]:
    b = backend.fork()
    b.allocate(1, len(ids) + s.max_tokens)
    return [ev.token for ev in stream_generate(b, FullAttentionMemory(b), tok, ids, s) if ev.token is not None]


def scheduler(tiny: TinyModel, **cfg: int) -> Scheduler:
    backend, tok = tiny.backend, tiny.tokenizer
    return Scheduler(backend.fork(), tok, SchedulerConfig(**{"max_batch": 3, "num_slots": 64, **cfg}))


def test_continuous_batching_equals_alone(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    ids = tok.encode(TEXT)
    jobs = [(ids[:n], settings(m)) for n, m in ((3, 10), (17, 4), (1, 12), (9, 6), (25, 3), (5, 9), (12, 1))]
    with scheduler(tiny) as sched:
        futures = [sched.submit(Request(p, s)) for p, s in jobs]
        done = [f.result(timeout=120) for f in futures]
    for (p, s), c in zip(jobs, done, strict=True):
        assert c.tokens == alone(backend, tok, p, s)
        assert c.text == tok.decode(c.tokens)
    assert sched.steps["mixed"] > 0 and sched.steps["decode"] > 0  # requests joined while others decoded


def test_cancel_one_leaves_others_intact(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    ids = tok.encode(TEXT)
    jobs = [(ids[:4], settings(14)), (ids[:9], settings(14)), (ids[:2], settings(14))]
    victim = Request(jobs[1][0], jobs[1][1])
    victim.on_event = lambda ev: victim.cancel() if ev.generated_tokens == 3 else None
    with scheduler(tiny) as sched:
        futures = [sched.submit(Request(*jobs[0])), sched.submit(victim), sched.submit(Request(*jobs[2]))]
        done = [f.result(timeout=120) for f in futures]
    assert done[1].finish_reason == "cancelled"
    assert done[1].tokens == alone(backend, tok, *jobs[1])[:3]
    for i in (0, 2):
        assert done[i].tokens == alone(backend, tok, *jobs[i])


def test_priorities_hold_under_a_full_queue(tiny: TinyModel) -> None:
    tok = tiny.tokenizer
    ids = tok.encode(TEXT)
    gate, started = threading.Event(), threading.Event()
    order: list[str] = []

    def hold(ev: GenerationEvent) -> None:  # runs on the scheduler thread: holds it until the queue is set up
        started.set()
        gate.wait(30)

    def first_token(name: str):  # type: ignore[no-untyped-def]
        return lambda ev: order.append(name) if ev.generated_tokens == 1 else None

    with scheduler(tiny, max_batch=1, max_queue=3) as sched:
        blocker = sched.submit(Request(ids[:3], settings(2), on_event=hold))
        assert started.wait(30)
        bg = [
            sched.submit(Request(ids[:5], settings(2), Priority.BACKGROUND, on_event=first_token(f"bg{i}")))
            for i in range(3)
        ]
        with pytest.raises(QueueFull):
            sched.submit(Request(ids[:5], settings(2), Priority.BACKGROUND))
        with pytest.raises(QueueFull):
            sched.submit(Request(ids[:5], settings(2), Priority.BACKGROUND), block=True, timeout=0.05)
        chat = sched.submit(Request(ids[:6], settings(2), Priority.INTERACTIVE, on_event=first_token("chat")))
        with pytest.raises(QueueFull):  # the latest background request gave its place to the chat
            bg[2].result(timeout=5)
        gate.set()
        blocker.result(timeout=60)
        chat.result(timeout=60)
        bg[0].result(timeout=60)
        bg[1].result(timeout=60)
    assert order == ["chat", "bg0", "bg1"]


def test_blocking_submit_waits_for_space(tiny: TinyModel) -> None:
    tok = tiny.tokenizer
    ids = tok.encode(TEXT)
    with scheduler(tiny, max_batch=1, max_queue=1, block_when_full=True) as sched:
        futures = [sched.submit(Request(ids[:4], settings(3))) for _ in range(4)]  # never raises: waits for space
        assert all(f.result(timeout=60).finish_reason in ("stop", "length") for f in futures)


def test_failed_request_leaves_others_intact(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    ids = tok.encode(TEXT)
    with scheduler(tiny, num_slots=16) as sched:
        ok = sched.submit(Request(ids[:4], settings(8)))
        too_long = sched.submit(Request(ids[:20], settings(8)))
        with pytest.raises(InputTooLarge):
            too_long.result(timeout=60)
        assert ok.result(timeout=60).tokens == alone(backend, tok, ids[:4], settings(8))


def test_stream_from_any_thread_and_early_exit_cancels(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    ids = tok.encode(TEXT)
    results: dict[str, object] = {}

    async def consume(sched: Scheduler) -> None:
        events = [ev async for ev in sched.stream(Request(ids[:7], settings(9)))]
        results["full"] = events
        quitter = Request(ids[:3], settings(30))
        async with contextlib.aclosing(sched.stream(quitter)) as events_:
            async for ev in events_:
                if ev.generated_tokens == 2:
                    break
        results["quitter_cancelled"] = quitter.cancelled

    with scheduler(tiny) as sched:
        other: Future = sched.submit(Request(ids[:5], settings(12)))
        t = threading.Thread(target=lambda: asyncio.run(consume(sched)))  # an event loop on another thread
        t.start()
        t.join(120)
        assert other.result(timeout=60).tokens == alone(backend, tok, ids[:5], settings(12))
    events = results["full"]
    assert isinstance(events, list)
    assert [e.token for e in events] == alone(backend, tok, ids[:7], settings(9))
    assert events[-1].finish_reason in ("stop", "length")
    assert results["quitter_cancelled"] is True


def test_continuous_batching_with_cascade_rows(tiny: TinyModel) -> None:
    """Each request gets its own cascade on its row; rows are reset between requests (same tokens as alone)."""
    from engine.memory.cascade.config import CascadeConfig
    from engine.memory.cascade.core import CascadeMemory

    backend, tok = tiny.backend, tiny.tokenizer
    cfg = CascadeConfig(
        sink_tokens=2, window=16, block_size=4, retrieval_blocks=2, routing="hybrid", proxy_tokens=4, reroute_every=4
    )
    ids = tok.encode(TEXT * 2)
    jobs = [(ids[:n], settings(m)) for n, m in ((30, 12), (6, 20), (21, 5), (2, 16), (12, 9))]
    config = SchedulerConfig(max_batch=2, num_slots=cfg.num_slots, mixed_chunk=4)  # chunking as alone: same cascade
    with Scheduler(backend.fork(), tok, config, lambda b, r: CascadeMemory(b, cfg, row=r)) as sched:
        done = [f.result(timeout=120) for f in [sched.submit(Request(p, s)) for p, s in jobs]]
    for (p, s), c in zip(jobs, done, strict=True):
        b = backend.fork()
        b.allocate(1, cfg.num_slots)
        assert c.tokens == [
            ev.token for ev in stream_generate(b, CascadeMemory(b, cfg), tok, p, s) if ev.token is not None
        ]


def test_a_request_extending_a_finished_one_continues_its_row(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    ids = tok.encode(TEXT)
    gate = threading.Event()
    with scheduler(tiny) as sched:
        other = sched.submit(
            Request(ids[20:25], settings(3), on_event=lambda ev: gate.wait(60) and None)
        )  # row 0, held
        first = sched.submit(Request(ids[:12], settings(6)))
        gate.set()
        first_done, other_done = first.result(timeout=120), other.result(timeout=120)
        extended = ids[:12] + first_done.tokens + ids[30:34]
        again = sched.submit(Request(extended, settings(5))).result(timeout=120)
        fresh = sched.submit(Request(ids[40:44], settings(2))).result(timeout=120)
    assert first_done.cached_tokens == 0 and other_done.cached_tokens == 0 and fresh.cached_tokens == 0
    assert (
        again.cached_tokens == 12 + len(first_done.tokens) - 1
    )  # all it fed: the prompt and the reply but its last token
    assert again.tokens == alone(backend, tok, extended, settings(5))  # continued exactly


def test_a_small_prompt_budget_per_step_changes_no_token(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    ids = tok.encode(TEXT)
    jobs = [(ids[:n], settings(m, chunk=8)) for n, m in ((13, 5), (17, 4), (9, 6))]
    with scheduler(tiny, step_prompt_tokens=6) as sched:
        futures = [sched.submit(Request(p, s)) for p, s in jobs]
        done = [f.result(timeout=120) for f in futures]
    for (p, s), c in zip(jobs, done, strict=True):
        assert c.tokens == alone(backend, tok, p, s)
    assert sched.steps["prefill"] >= 3  # 39 prompt tokens at most 6 a step: the first steps take turns


def test_idle_rows_give_their_table_back_and_serve_again(tiny: TinyModel) -> None:
    backend, tok = tiny.backend, tiny.tokenizer
    ids = tok.encode(TEXT)
    want = alone(backend, tok, ids, settings(6))
    row_backend = backend.fork()
    with Scheduler(row_backend, tok, SchedulerConfig(max_batch=3, num_slots=64, idle_release_s=0.05)) as sched:
        assert row_backend.cache.capacity == 0  # 3 rows of 64 slots declared, none held before a request
        assert sched.submit(Request(ids, settings(6))).result(timeout=120).tokens == want
        for _ in range(200):  # the scheduler thread releases after 0.05 s idle
            if row_backend.cache.capacity == 0:
                break
            threading.Event().wait(0.05)
        assert row_backend.cache.capacity == 0 and row_backend.kv_resident_bytes() < 64 * 3 * 2 * 2 * 16 * 2
        assert sched.submit(Request(ids, settings(6))).result(timeout=120).tokens == want
        assert row_backend.cache.capacity > 0


class Recorder:
    """A RowAttachment that records what the scheduler told it, and the events its request had by then."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.log: list[str] = []
        self.memory: Memory | None = None
        self.events_at_observe = -1
        self.events: list[GenerationEvent] = []

    def __call__(self, memory: Memory) -> Recorder:
        self.memory = memory
        self.log.append("attach")
        if self.fail:
            raise ValueError("this file will not attach")
        return self

    def observe(self) -> None:
        self.log.append("observe")
        self.events_at_observe = len(self.events)

    def detach(self) -> None:
        self.log.append("detach")


def test_attach_hook_runs_at_admission_observes_before_the_first_event_and_detaches_at_the_end(
    tiny: TinyModel,
) -> None:
    ids = tiny.tokenizer.encode(TEXT)
    hook, failing = Recorder(), Recorder(fail=True)
    with scheduler(tiny) as sched:
        c = sched.submit(Request(ids[:12], settings(3), attach=hook, on_event=hook.events.append)).result(timeout=120)
        assert len(c.tokens) == 3
        assert hook.log == ["attach", "observe", "detach"] and hook.events_at_observe == 0
        assert hook.memory is not None and not hook.memory.tokens  # the row forgot the request with attachments
        with pytest.raises(ValueError, match="will not attach"):
            sched.submit(Request(ids[:5], settings(2), attach=failing)).result(timeout=120)
        assert failing.log == ["attach"]
        plain = sched.submit(Request(ids[:12], settings(3))).result(timeout=120)  # the rows still serve
    assert plain.tokens == c.tokens
