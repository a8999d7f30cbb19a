"""The remote backend (engine.openai.client) against our own server on loopback, and against broken servers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.generation.loop import GenerationEvent, GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.memory.base import FullAttentionMemory
from engine.openai.client import RemoteClient, RemoteError, RemoteServer, RemoteSession
from engine.session.file import ForeignModelSession, restore
from tests.helpers.http_clients import closed_after_test
from tests.helpers.server import KEY, Served

GREEDY = GenerationSettings(max_tokens=12, sampling=SamplingSettings(greedy=True))


def remote(served: Served, key: str = KEY, model: str = "tiny") -> RemoteClient:
    return closed_after_test(RemoteClient(RemoteServer(served.url, model, key)))


def test_streams_what_the_server_answers(served: Served) -> None:
    messages = [{"role": "user", "content": "The quick brown fox"}]
    want = closed_after_test(openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0)).chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    events = list(remote(served).stream_chat(messages, GREEDY))
    assert "".join(e.text for e in events) == want.choices[0].message.content
    last = events[-1]
    assert last.finish_reason == want.choices[0].finish_reason
    assert (last.prompt_tokens, last.generated_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)  # type: ignore[union-attr]
    assert all(e.finish_reason is None for e in events[:-1])
    assert remote(served).list_models() == ["tiny"]


def test_session_keeps_the_transcript(served: Served, tmp_path: Path) -> None:
    session = RemoteSession(remote(served), system_prompt="Be brief.")
    first = "".join(e.text for e in session.chat("Python is", GREEDY))
    second = "".join(e.text for e in session.chat("And the fox?", GREEDY))
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    assert [session.messages[1]["content"], session.messages[3]["content"]] == [first, second]
    assert served.service.metrics.cached_tokens > 0  # the server reused the first turn for the second
    # The transcript saves; a local model opens it as another model's transcript, to be re-read.
    path = tmp_path / "remote.spark"
    assert session.save(path) > 0
    local = served.backend.fork()
    opened = restore(path, local, lambda b: FullAttentionMemory(b))
    assert isinstance(opened, ForeignModelSession)
    assert [(m.role, m.content) for m in opened.data.messages] == [(m["role"], m["content"]) for m in session.messages]
    assert opened.data.system_prompt == "Be brief."


def test_stopping_cancels_on_the_server(served: Served) -> None:
    before = served.service.metrics.reasons.get("cancelled", 0)
    long = GenerationSettings(max_tokens=4000, sampling=SamplingSettings(greedy=True))
    messages = [{"role": "user", "content": "The quick brown fox jumps over"}]
    events: list[GenerationEvent] = []
    for ev in remote(served).stream_chat(messages, long, should_stop=lambda: len(events) >= 3):
        events.append(ev)
    assert events[-1].finish_reason == "cancelled" and len(events) == 4  # (this reply is long: it was cut short)
    for _ in range(600):  # a bound on waiting, not a speed requirement
        if served.service.scheduler.running == 0 and served.service.metrics.reasons.get("cancelled", 0) > before:
            break
        time.sleep(0.05)
    assert served.service.scheduler.running == 0
    assert served.service.metrics.reasons.get("cancelled", 0) == before + 1


def test_errors_are_one_sentence(served: Served) -> None:
    with pytest.raises(RemoteError, match="refused the API key"):
        list(remote(served, key="wrong").stream_chat([{"role": "user", "content": "hi"}], GREEDY))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    with pytest.raises(RemoteError, match="Cannot reach"):
        closed_after_test(RemoteClient(RemoteServer(f"http://127.0.0.1:{port}/v1", "tiny"))).list_models()
    with pytest.raises(RemoteError, match="not a server address"):
        RemoteServer("ftp://x", "tiny")


@pytest.mark.parametrize(
    "body",
    [b"data: {not json}\n\n", b"data: [1, 2]\n\n", b'data: {"error": {"message": "out of memory"}}\n\n'],
)
def test_a_broken_stream_is_an_error_not_a_crash(body: bytes) -> None:
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    )
    client = closed_after_test(RemoteClient(RemoteServer("http://remote.invalid/v1", "m"), transport=transport))
    with pytest.raises(RemoteError) as e:
        list(client.stream_chat([{"role": "user", "content": "hi"}], GREEDY))
    assert "\n" not in str(e.value)


def test_stop_takes_effect_while_the_server_is_silent() -> None:
    release = threading.Event()
    spoke: list[bool] = []

    def silent() -> Iterator[bytes]:  # a server still reading a long prompt: nothing comes until released
        release.wait(timeout=30)  # (a bound for the failing case only)
        spoke.append(True)
        yield b'data: {"choices": [{"delta": {"content": "late"}}]}\n\n'

    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, content=silent(), headers={"content-type": "text/event-stream"})
    )
    client = RemoteClient(RemoteServer("http://remote.invalid/v1", "m"), transport=transport)
    events = list(client.stream_chat([{"role": "user", "content": "hi"}], GREEDY, should_stop=lambda: True))
    assert not spoke  # cancelled while the server was still silent, not at its next chunk
    assert [(e.text, e.finish_reason) for e in events] == [("", "cancelled")]
    release.set()
    client.close()


def test_any_model_name_a_client_sends_is_served_by_the_loaded_model(served: Served) -> None:
    events = list(remote(served, model="gpt-4o").stream_chat([{"role": "user", "content": "hi"}], GREEDY))
    assert events and events[-1].finish_reason in ("stop", "length")
    from engine.openai.errors import ApiError
    from engine.openai.pool import ModelPool, Servable

    pool = ModelPool([Servable("tiny"), Servable("other")], served.service.config, None)
    assert pool.resolve("other") == "other"  # a model it serves: that one
    with pytest.raises(ApiError) as info:  # serving several, a placeholder names none of them
        pool.resolve("gpt-4o")
    assert info.value.status == 404 and "'tiny', 'other'" in info.value.message
