"""The remote client against servers that lie: every malformed answer is one RemoteError sentence, never a crash,
an empty "stop", or memory and time without bound. Plus a hypothesis fuzz target over composed replies."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.generation.loop import GenerationEvent, GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.openai.client import RemoteClient, RemoteError, RemoteServer, ReplyLimits
from tests.helpers.fuzz import fuzz_examples
from tests.helpers.http_clients import closed_after_test

GREEDY = GenerationSettings(max_tokens=12, sampling=SamplingSettings(greedy=True))
SSE = {"content-type": "text/event-stream"}
SMALL = ReplyLimits(
    first_byte_s=2.0, reply_s=20.0, line_bytes=4096, reply_bytes=64 << 10, error_bytes=1024, list_bytes=64 << 10
)
CHUNK = b'data: {"choices": [{"delta": {"content": "ok"}, "finish_reason": null}]}\n\n'


def client_for(handler: Callable[[httpx.Request], httpx.Response], limits: ReplyLimits = SMALL) -> RemoteClient:
    transport = httpx.MockTransport(handler)
    return closed_after_test(RemoteClient(RemoteServer("http://remote.invalid/v1", "m"), transport, limits))


def reply(client: RemoteClient) -> list[GenerationEvent]:
    return list(client.stream_chat([{"role": "user", "content": "hi"}], GREEDY))


def one_sentence(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and text.endswith(".") and len(text) < 400, text
    return text


def endless(piece: bytes) -> Iterator[bytes]:
    yield from itertools.repeat(piece)


HOSTILE: dict[str, tuple[Callable[[httpx.Request], httpx.Response], str]] = {
    "html with a 200": (
        lambda r: httpx.Response(
            200, content=b"<html><body>Login</body></html>", headers={"content-type": "text/html"}
        ),
        "web page",
    ),
    "an empty 200": (lambda r: httpx.Response(200, content=b"", headers=SSE), "no reply in OpenAI's streaming format"),
    "plain text": (lambda r: httpx.Response(200, content=b"hello\nworld\n", headers=SSE), "no reply"),
    "choices of the wrong type": (
        lambda r: httpx.Response(200, content=b'data: {"choices": 7}\n\n', headers=SSE),
        "not OpenAI",
    ),
    "bad JSON": (lambda r: httpx.Response(200, content=b"data: {oops\n\n", headers=SSE), "not OpenAI"),
    "a number past the parser's limit": (
        lambda r: httpx.Response(200, content=b'data: {"usage": ' + b"9" * 5000 + b"}\n\n", headers=SSE),
        "not OpenAI",
    ),
    "nesting past the parser's limit": (
        lambda r: httpx.Response(200, content=b"data: " + b"[" * 3000 + b"\n\n", headers=SSE),
        "not OpenAI",
    ),
    "bad UTF-8": (lambda r: httpx.Response(200, content=b"data: \xff\xfe\n\n", headers=SSE), "not UTF-8"),
    "a redirect to another host": (
        lambda r: httpx.Response(302, headers={"location": "https://evil.example/v1/chat/completions"}),
        "redirects to evil.example",
    ),
    "a 500 with a page of HTML": (
        lambda r: httpx.Response(500, content=b"<html>" + b"x\n" * 100_000 + b"</html>"),
        "failed on this request (500)",
    ),
    "a 502 with an error sentence": (
        lambda r: httpx.Response(502, json={"error": {"message": "upstream\n\x1b[31mdown\x1b[0m"}}),
        "upstream",
    ),
    "a 429 with a huge Retry-After": (
        lambda r: httpx.Response(429, headers={"retry-after": "9" * 4000}),
        "busy; try again later",
    ),
    "a 429 with a sane Retry-After": (lambda r: httpx.Response(429, headers={"retry-after": "3"}), "in 3 s"),
    "a line that never ends": (
        lambda r: httpx.Response(200, content=endless(b"data: " + b"x" * 1000), headers=SSE),
        "line longer",
    ),
    "a stream that never ends": (
        lambda r: httpx.Response(200, content=endless(CHUNK), headers=SSE),
        "more than",
    ),
    "an error event": (
        lambda r: httpx.Response(200, content=b'data: {"error": {"message": "' + b"x" * 1000 + b'"}}\n\n', headers=SSE),
        "stopped with an error",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_each_malformed_answer_is_one_sentence(case: str) -> None:
    handler, words = HOSTILE[case]
    with pytest.raises(RemoteError) as e:
        reply(client_for(handler))
    assert words in one_sentence(e.value)


def test_a_server_that_never_starts_its_reply_meets_the_first_byte_deadline() -> None:
    def silent() -> Iterator[bytes]:
        yield from ()
        raise httpx.ReadTimeout("silent")  # what the read timeout says once it passes

    limits = ReplyLimits(first_byte_s=0.2)
    with pytest.raises(RemoteError) as e:
        reply(client_for(lambda r: httpx.Response(200, content=silent(), headers=SSE), limits))
    assert "did not answer in time" in one_sentence(e.value)


def test_wrong_types_in_usage_do_not_crash_and_the_text_arrives() -> None:
    body = (
        CHUNK
        + b'data: {"choices": [], "usage": {"prompt_tokens": "many", "completion_tokens": [1]}}\n\ndata: [DONE]\n\n'
    )
    events = reply(client_for(lambda r: httpx.Response(200, content=body, headers=SSE)))
    assert "".join(e.text for e in events) == "ok" and events[-1].finish_reason == "stop"


def test_a_model_list_in_another_shape_or_too_big_is_one_sentence() -> None:
    for content in (b"[1, 2]", b'{"data": 5}', b"<html></html>", b'{"data": [' + b'{"id": "m"},' * 100_000 + b"{}]}"):
        client = client_for(lambda r, content=content: httpx.Response(200, content=content))
        with pytest.raises(RemoteError) as e:
            client.list_models()
        one_sentence(e.value)
    good = client_for(lambda r: httpx.Response(200, json={"data": [{"id": "a"}, {"id": 5}, "x"]}))
    assert good.list_models() == ["a"]


# -- the fuzz target: replies composed of good and hostile pieces ------------------------------------------------

PIECES = st.sampled_from(
    [
        CHUNK,
        b"data: [DONE]\n\n",
        b": keep-alive\n\n",
        b"event: message\n",
        b'data: {"choices": [{"delta": {"content": 5}}]}\n\n',
        b'data: {"choices": [{"delta": "x", "finish_reason": [1]}]}\n\n',
        b'data: {"choices": null, "usage": {"prompt_tokens": -1}}\n\n',
        b'data: {"choices": "abc"}\n\n',
        b'data: {"error": null}\n\n',
        b"data: null\n\n",
        b"data: \n\n",
        b"\r\n",
        b"\xff",
        b"data: " + b"7" * 5000 + b"\n\n",
        b'data: {"choices": [{"delta": {"content": "\\ud800"}}]}\n\n',
    ]
)


@settings(max_examples=fuzz_examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(PIECES, max_size=12),
    raw=st.binary(max_size=64),
    status=st.sampled_from([200, 200, 200, 204, 301, 400, 404, 429, 500, 503]),
    kind=st.sampled_from(["text/event-stream", "application/json", "text/html", ""]),
)
def test_fuzz_remote_replies(pieces: list[bytes], raw: bytes, status: int, kind: str) -> None:
    body = b"".join(pieces) + raw
    headers = {"content-type": kind, "retry-after": "1e99", "location": "http://elsewhere.invalid/"}
    client = client_for(lambda r: httpx.Response(status, content=body, headers=headers))
    try:
        events = reply(client)
    except RemoteError as e:
        one_sentence(e)
        return
    assert status == 200 and kind != "text/html"
    assert events[-1].finish_reason is not None
    "".join(e.text for e in events).encode("utf-8")  # text that can be shown and saved


def test_a_silent_server_fails_the_model_list_within_its_deadline() -> None:
    """A loopback socket that takes the connection and never answers: the list fails with one sentence after
    `list_s`, not after the chat stream's first-byte wait."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        limits = ReplyLimits(first_byte_s=3600.0, list_s=0.5)
        client = closed_after_test(RemoteClient(RemoteServer(f"http://127.0.0.1:{port}/v1", "m"), None, limits))
        with pytest.raises(RemoteError) as info:
            client.list_models()
    assert "did not answer in time" in one_sentence(info.value)


def test_a_dripping_model_list_meets_its_deadline() -> None:
    import time

    def drip() -> Iterator[bytes]:
        for _ in range(10_000):
            time.sleep(0.01)
            yield b" "

    client = client_for(lambda r: httpx.Response(200, content=drip()), ReplyLimits(list_s=0.3))
    with pytest.raises(RemoteError) as info:
        client.list_models()
    assert "did not answer in time" in one_sentence(info.value)
