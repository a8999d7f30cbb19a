"""A conversation's pictures and a remote server: to a server whose model sees images each `<image>` marker goes as an
OpenAI `image_url` part holding the picture (our own server on loopback answers exactly as to the same request sent
directly); to any other nothing is sent while the conversation shows a picture, in one sentence; a saved remote
transcript keeps its pictures. Where a server says whether its model sees images (llama.cpp, Ollama, LM Studio),
"Check" hears it."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.openai.client import (
    CANNOT_SEE_IMAGES,
    RemoteClient,
    RemoteError,
    RemoteServer,
    RemoteSession,
    ReplyLimits,
    wire_messages,
)
from engine.session.file import load_session
from engine.vision.idefics3 import IMAGE_TOKEN
from engine.vision.images import DecodedImage
from tests.helpers.http_clients import closed_after_test
from tests.helpers.pictures import picture, png
from tests.helpers.server import KEY, Served, start_server

pytest.importorskip("transformers")
GREEDY = GenerationSettings(max_tokens=8, sampling=SamplingSettings(greedy=True))
SSE = b'data: {"choices":[{"delta":{"content":"ok"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'


def data_url(p: DecodedImage) -> str:
    return "data:image/png;base64," + base64.b64encode(p.data).decode()


class Recorder:
    """A fake remote: records each request's JSON body and answers "ok"."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        return httpx.Response(200, content=SSE, headers={"content-type": "text/event-stream"})


def fake(sees_images: bool) -> tuple[RemoteSession, Recorder]:
    rec = Recorder()
    server = RemoteServer("http://remote.test/v1", "vlm", sees_images=sees_images)
    return RemoteSession(closed_after_test(RemoteClient(server, httpx.MockTransport(rec)))), rec


def test_pictures_go_as_image_url_parts_where_their_markers_sit() -> None:
    a, b = picture(16, 12, 1), picture(10, 10, 2)
    session, rec = fake(sees_images=True)
    session.system_prompt = "Be brief."
    assert "".join(e.text for e in session.chat("Which is brighter?", GREEDY, images=[a, b])) == "ok"
    assert "".join(e.text for e in session.chat(f"Now {IMAGE_TOKEN} this one.", GREEDY, images=[a])) == "ok"
    first, second = rec.bodies
    assert first["messages"] == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(a)}},
                {"type": "image_url", "image_url": {"url": data_url(b)}},
                {"type": "text", "text": "Which is brighter?"},
            ],
        },
    ]
    assert second["messages"][1] == first["messages"][1] and second["messages"][2] == {
        "role": "assistant",
        "content": "ok",
    }
    assert second["messages"][3]["content"] == [
        {"type": "text", "text": "Now "},
        {"type": "image_url", "image_url": {"url": data_url(a)}},
        {"type": "text", "text": " this one."},
    ]
    assert IMAGE_TOKEN not in json.dumps([first, second])  # never a marker as if the user had typed it
    assert [p.sha256 for p in session.images] == [a.sha256, b.sha256, a.sha256]


def test_a_server_whose_model_cannot_see_is_sent_nothing_while_the_conversation_shows_a_picture() -> None:
    session, rec = fake(sees_images=False)
    with pytest.raises(RemoteError) as refused:
        session.chat("What is this?", GREEDY, images=[picture(8, 8, 3)])
    assert str(refused.value) == CANNOT_SEE_IMAGES and "\n" not in CANNOT_SEE_IMAGES
    assert session.messages == [] and session.images == []  # nothing of the turn was taken
    # A conversation moved here with pictures from a local model: neither a new turn nor a regenerated one goes.
    session.messages = [{"role": "user", "content": f"{IMAGE_TOKEN}What is it?"}, {"role": "assistant", "content": "A"}]
    session.images = [picture(8, 8, 4)]
    with pytest.raises(RemoteError, match="cannot see images"):
        session.chat("And now?", GREEDY)
    with pytest.raises(RemoteError, match="cannot see images"):
        session.regenerate(GREEDY)
    assert rec.bodies == [] and len(session.messages) == 2
    # Text alone goes as before, a marker the user typed included (there is no picture it could stand for).
    plain, rec = fake(sees_images=False)
    assert "".join(e.text for e in plain.chat(f"What does {IMAGE_TOKEN} mean in HTML?", GREEDY)) == "ok"
    assert rec.bodies[0]["messages"] == [{"role": "user", "content": f"What does {IMAGE_TOKEN} mean in HTML?"}]


def test_markers_and_pictures_must_agree_as_in_a_local_session() -> None:
    session, rec = fake(sees_images=True)
    with pytest.raises(RemoteError, match="marks where a picture goes; attach one"):
        session.chat(f"{IMAGE_TOKEN} alone", GREEDY)
    with pytest.raises(RemoteError, match="places 2 images but 1 were given"):
        session.chat(f"{IMAGE_TOKEN}{IMAGE_TOKEN}", GREEDY, images=[picture(8, 8, 5)])
    assert rec.bodies == [] and session.messages == []


def test_wire_messages_leaves_assistant_text_and_a_marker_without_a_picture_as_text() -> None:
    p = picture(8, 8, 6)
    sent = wire_messages(
        [
            {"role": "user", "content": f"{IMAGE_TOKEN}x{IMAGE_TOKEN}"},
            {"role": "assistant", "content": f"I see {IMAGE_TOKEN}"},
        ],
        [p],
    )
    assert sent == [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url(p)}}, {"type": "text", "text": "x<image>"}],
        },
        {"role": "assistant", "content": f"I see {IMAGE_TOKEN}"},
    ]


def test_a_saved_remote_transcript_keeps_its_pictures_once_each(tmp_path: Path) -> None:
    a = picture(12, 12, 7)
    session, _rec = fake(sees_images=True)
    list(session.chat("One", GREEDY, images=[a]))
    list(session.chat("Again", GREEDY, images=[a]))
    path = tmp_path / "remote.spark"
    session.save(path)
    data = load_session(path)
    assert [p.sha256 for p in data.images] == [a.sha256, a.sha256] and data.images[0].data == a.data
    assert [m.content for m in data.messages if m.role == "user"] == [f"{IMAGE_TOKEN}One", f"{IMAGE_TOKEN}Again"]


@pytest.fixture(scope="module")
def vision_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from tests.helpers.tiny_idefics3 import make_tiny_idefics3

    s = start_server(
        make_tiny_idefics3(tmp_path_factory.mktemp("idefics3")), tmp_path_factory.mktemp("kv"), vision=True
    )
    yield s
    s.server.stop()


def test_our_own_server_answers_the_picture_as_it_answers_the_same_request_sent_directly(
    vision_served: Served,
) -> None:
    data = png(40, 24, 8)
    pic = picture(40, 24, 8)
    server = RemoteServer(vision_served.url, "tiny", KEY, sees_images=True)
    session = RemoteSession(closed_after_test(RemoteClient(server)))
    got = "".join(e.text for e in session.chat("What is in it?", GREEDY, images=[pic]))
    content: Any = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}},
        {"type": "text", "text": "What is in it?"},
    ]
    client = closed_after_test(openai.OpenAI(base_url=vision_served.url, api_key=KEY, max_retries=0))
    want = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert got == want.choices[0].message.content and got
    # Without the picture the same question is another prompt: the picture reached the model.
    text_only = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is in it?"}],
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert text_only.usage is not None and want.usage is not None
    assert want.usage.prompt_tokens > text_only.usage.prompt_tokens


def asking(routes: dict[tuple[str, str], httpx.Response]) -> RemoteClient:
    """A fake server answering `routes` ((method, path) -> response) and 404 to anything else."""

    def handler(request: httpx.Request) -> httpx.Response:
        return routes.get((request.method, request.url.raw_path.decode()), httpx.Response(404))

    server = RemoteServer("http://remote.test/v1", "org/vlm")
    return closed_after_test(RemoteClient(server, httpx.MockTransport(handler)))


@pytest.mark.parametrize(
    ("routes", "says"),
    [
        ({("GET", "/props"): httpx.Response(200, json={"modalities": {"vision": True, "audio": False}})}, True),
        ({("GET", "/props"): httpx.Response(200, json={"modalities": {"vision": False}})}, False),
        ({("POST", "/api/show"): httpx.Response(200, json={"capabilities": ["completion", "vision"]})}, True),
        ({("POST", "/api/show"): httpx.Response(200, json={"capabilities": ["completion", "tools"]})}, False),
        ({("GET", "/api/v0/models/org%2Fvlm"): httpx.Response(200, json={"type": "vlm"})}, True),
        ({("GET", "/api/v0/models/org%2Fvlm"): httpx.Response(200, json={"type": "llm"})}, False),
        ({}, None),  # OpenAI's API alone does not say: the user's word stands
        # Shapes that say nothing are passed over, never taken for a yes.
        ({("GET", "/props"): httpx.Response(200, json={"modalities": {"vision": "yes"}})}, None),
        ({("POST", "/api/show"): httpx.Response(200, json={"capabilities": ["vision", 1]})}, None),
        ({("GET", "/props"): httpx.Response(200, text="<html>not JSON</html>")}, None),
        ({("GET", "/api/v0/models/org%2Fvlm"): httpx.Response(200, json={"type": ["vlm"]})}, None),
    ],
)
def test_a_server_that_says_whether_its_model_sees_images_is_heard(
    routes: dict[tuple[str, str], httpx.Response], says: bool | None
) -> None:
    assert asking(routes).sees_images() is says


def test_the_probe_names_the_model_and_reads_no_more_than_a_model_list_may_hold() -> None:
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        if request.url.path == "/props":
            return httpx.Response(200, json={"modalities": {"vision": True}, "pad": "x" * 500})
        return httpx.Response(404)

    server = RemoteServer("http://remote.test/v1", "org/vlm")
    small = closed_after_test(RemoteClient(server, httpx.MockTransport(handler), ReplyLimits(list_bytes=100)))
    assert small.sees_images() is None  # the answer was longer than the limit: not read
    assert json.loads(bodies[1]) == {"model": "org/vlm"}  # Ollama's show names the model
