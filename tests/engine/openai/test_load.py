"""Load on loopback: 32 concurrent streaming clients (a bounded count, each with a time bound). Every stream
completes and equals the same request run alone (greedy); clients killed mid-stream free their rows; nothing
is lost; memory stays bounded across waves."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from tests.helpers.http_clients import closed_after_test
from tests.helpers.server import KEY, Served, start_server

CLIENTS = 32
KILLED = {3, 11, 19, 27}  # these close their stream after the first chunk
TEXT = "The quick brown fox jumps over the lazy dog. Python is a programming language. def main(): return 42"


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start_server(tiny_dir, tmp_path_factory.mktemp("kv-load"), max_batch=8, max_queue=CLIENTS)
    yield s
    s.server.stop()


def messages(i: int) -> list[dict[str, str]]:
    words = TEXT.split()
    return [{"role": "user", "content": f"{i}: " + " ".join(words[i % 7 : i % 7 + 3 + i % 5])}]


async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
    """Stream request i; returns (text, finish_reason), or the text so far and None for a killed client."""
    # A killed client asks for a long reply so it is surely still generating when it leaves.
    long = {"max_tokens": 2000, "extra_body": {"ignore_eos": True}} if i in KILLED else {"max_tokens": 10}
    stream = await client.chat.completions.create(
        model="tiny", messages=messages(i), temperature=0, stream=True, **long
    )  # type: ignore[call-overload]
    text, reason = "", None
    async for chunk in stream:
        if not chunk.choices:
            continue
        text += chunk.choices[0].delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
        if i in KILLED and text:
            await stream.close()  # the client goes away mid-stream
            return text, None
    return text, reason


async def wave(served: Served) -> list[tuple[str, str | None]]:
    client = openai.AsyncOpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=120)
    try:
        return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(CLIENTS))), timeout=300)
    finally:
        await client.close()


def cancelled(served: Served) -> int:
    return served.service.metrics.reasons.get("cancelled", 0)


def settle(served: Served, cancels: int) -> None:
    """Wait (60 s at most: a bound, not a speed requirement) until no row is busy and the cancels are counted."""
    sched = served.service.scheduler
    for _ in range(600):
        if sched.running == 0 and sched.waiting == 0 and cancelled(served) == cancels:
            return
        time.sleep(0.1)


def test_32_streaming_clients(loaded: Served) -> None:
    rss = psutil.Process(os.getpid())
    got = asyncio.run(wave(loaded))
    settle(loaded, len(KILLED))
    after_first = rss.memory_info().rss
    assert loaded.service.scheduler.running == 0 and loaded.service.scheduler.waiting == 0  # every row is free
    assert cancelled(loaded) == len(KILLED)  # each killed client cancelled its own generation, nothing else did

    # Each request alone (one at a time) gives what it gave under load.
    client = closed_after_test(openai.OpenAI(base_url=loaded.url, api_key=KEY, max_retries=0, timeout=120))
    for i, (text, reason) in enumerate(got):
        if i in KILLED:
            assert text and reason is None
            continue
        alone = client.chat.completions.create(model="tiny", messages=messages(i), max_tokens=10, temperature=0)  # type: ignore[arg-type]
        assert (text, reason) == (alone.choices[0].message.content, alone.choices[0].finish_reason), f"client {i}"

    # A second wave: the same answers, and no growth beyond noise (rows, slot table and queue are fixed).
    again = asyncio.run(wave(loaded))
    settle(loaded, 2 * len(KILLED))
    assert [g for i, g in enumerate(again) if i not in KILLED] == [g for i, g in enumerate(got) if i not in KILLED]
    assert rss.memory_info().rss - after_first < 64 * 1024**2
    assert len(loaded.service.memories) == 8  # one memory per row, never one per request
