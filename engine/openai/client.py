"""A remote OpenAI-compatible server (vLLM, Ollama, llama.cpp, LM Studio, our own `serve`) as a chat backend.

`RemoteClient` streams a chat reply from base URL + API key + model with httpx and yields the same
`GenerationEvent`s a local session does, so the app's worker treats both alike. There is no cascade or session
memory on this path: the server holds whatever memory it has; `RemoteSession` keeps the transcript only.
Every failure is a `RemoteError` with one sentence naming the problem and what to do.

Shapes of what comes back are checked as hostile input: a server that sends something else than OpenAI's
format ends the reply with an error, never a crash. The stream is read on a thread of its own, so Stop (and quitting)
takes effect at once even while the server is silent (a big model reading a long prompt), not at its next chunk.
"""

from __future__ import annotations

import base64
import hashlib
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from engine.errors import SparkError
from engine.generation.loop import FinishReason, GenerationEvent, GenerationSettings
from engine.hw.memory import format_bytes
from engine.openai.protocol import parse_finish_reason
from engine.session.file import TRANSCRIPT_KIND, Message, save_session
from engine.session.pictures import image_tensors
from engine.vision.idefics3 import IMAGE_TOKEN
from engine.vision.images import DecodedImage, media_type

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 300.0  # between two chunks of a stream (a big model's first token can take a while)


@dataclass(frozen=True)
class ReplyLimits:
    """Deadlines and sizes a server's reply must keep to: past one, the reply ends with one sentence saying which."""

    first_byte_s: float = 300.0  # request sent -> first line (a big model reading a long prompt)
    reply_s: float = 3600.0  # request sent -> the whole reply
    line_bytes: int = 1 << 20  # one SSE line (a chunk of a few tokens is ~300 bytes)
    reply_bytes: int = 64 << 20  # the whole reply
    error_bytes: int = 64 << 10  # an error body, read for its message only
    list_bytes: int = 8 << 20  # a model list
    list_s: float = 15.0  # a model list, whole: connect, headers and body (a silent server fails in seconds)
    probe_s: float = 5.0  # one question about what the server's model takes (each probe of `sees_images`)


MAX_RETRY_AFTER_S = 86_400  # a Retry-After past a day is not advice worth passing on
STOP_POLL_S = 0.05  # how often a silent stream checks for Stop
QUEUED_LINES = 1024  # lines read ahead of the consumer; the reader waits beyond that (a flooding server is held back)
_END = object()


def _clause(text: str, limit: int = 200) -> str:
    """A server's own text as a clause of our sentence: printable, one line, bounded, no trailing period."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return (flat[:limit] + "…" if len(flat) > limit else flat).rstrip(".")


def _read_capped(response: httpx.Response, limit: int, deadline: float | None = None) -> bytes | None:
    """The body, or None when it passes `limit` bytes (nothing past the limit is read); past `deadline`
    (monotonic) a ReadTimeout, so a server dripping its body cannot hold the call."""
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > limit:
            return None
        if deadline is not None and time.monotonic() > deadline:
            raise httpx.ReadTimeout("the reply took too long", request=response.request)
    return bytes(body)


def _loads(data: bytes | str) -> Any:
    """JSON, or None for anything that is not (bad syntax, bad UTF-8, nesting or digits past the parser's limits)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # JSONDecodeError and the int-digit limit are ValueErrors
        return None


def _whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53 else None


class RemoteError(SparkError):
    """The remote server cannot be reached, refused the request, or answered in an unexpected shape."""


@dataclass(frozen=True)
class RemoteServer:
    """Where a remote model lives: what "Add a server…" asks for."""

    base_url: str  # e.g. http://192.168.1.20:8000/v1
    model: str
    api_key: str = ""
    sees_images: bool = False  # the user says the model takes pictures: they go as image_url parts

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise RemoteError(f"{self.base_url!r} is not a server address; give one like http://host:8000/v1.")
        if not self.model.strip():
            raise RemoteError("Name the model to use on the server (see its model list).")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/")


def _error_message(response: httpx.Response, limit: int) -> str:
    """The server's own error sentence from an OpenAI error body, if it sent one (as a clause)."""
    raw = _read_capped(response, limit)
    body = _loads(raw) if raw else None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return _clause(err["message"])
    if isinstance(err, str):
        return _clause(err)
    return ""


class RemoteClient:
    """Talks to one remote server. `transport` is for tests (httpx's mock transport); None uses the network."""

    def __init__(
        self, server: RemoteServer, transport: httpx.BaseTransport | None = None, limits: ReplyLimits = ReplyLimits()
    ) -> None:
        self.server = server
        self.limits = limits
        headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self._http = httpx.Client(headers=headers, timeout=timeout, transport=transport, follow_redirects=False)

    def close(self) -> None:
        self._http.close()

    def _fail(self, response: httpx.Response) -> RemoteError:
        where = self.server.url
        status = response.status_code
        if status in (401, 403):
            return RemoteError(f"The server at {where} refused the API key; check the key in the server's settings.")
        if 300 <= status < 400:
            target = urlsplit(response.headers.get("location", ""))
            elsewhere = target.netloc and target.netloc != urlsplit(where).netloc
            return RemoteError(
                f"The server at {where} redirects to {_clause(target.netloc, 80) if elsewhere else 'another address'}; "
                "give the address it redirects to, if you trust it."
            )
        detail = _error_message(response, self.limits.error_bytes)
        if status == 404 and detail:
            return RemoteError(f"The server at {where} says: {detail}.")
        if status == 404:
            return RemoteError(
                f"The server at {where} has no OpenAI-compatible API there; check the address (it usually ends in /v1)."
            )
        if status in (429, 503):
            wait = response.headers.get("retry-after", "").strip()
            seconds = int(wait) if wait.isascii() and wait.isdigit() and len(wait) <= 6 else None
            when = f" in {seconds} s" if seconds is not None and seconds <= MAX_RETRY_AFTER_S else " later"
            return RemoteError(f"The server at {where} is busy; try again{when}.")
        if status >= 500:
            return RemoteError(
                f"The server at {where} failed on this request ({status}{': ' + detail if detail else ''}); try again or check the server."
            )
        return RemoteError(
            f"The server at {where} answered {status}: {detail or _clause(response.reason_phrase) or 'no reason given'}."
        )

    def _unreachable(self, exc: httpx.HTTPError) -> RemoteError:
        if isinstance(exc, httpx.TimeoutException):
            return RemoteError(
                f"The server at {self.server.url} did not answer in time; check that it is running and reachable."
            )
        return RemoteError(
            f"Cannot reach the server at {self.server.url}; check the address and that the server is running."
        )

    def list_models(self) -> list[str]:
        """The model names the server offers (GET /models), under a deadline of `limits.list_s` for the whole call
        (the chat stream's long first-byte wait is for a model reading a prompt; a list has no such excuse)."""
        deadline = time.monotonic() + self.limits.list_s
        timeout = httpx.Timeout(self.limits.list_s, connect=min(CONNECT_TIMEOUT_S, self.limits.list_s))
        try:
            with self._http.stream("GET", self.server.url + "/models", timeout=timeout) as response:
                if response.status_code != 200:
                    raise self._fail(response)
                raw = _read_capped(response, self.limits.list_bytes, deadline)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        body = _loads(raw) if raw is not None else None
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise RemoteError(f"The server at {self.server.url} sent a model list that is not OpenAI's format.")
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def sees_images(self) -> bool | None:
        """Whether the server says its model takes pictures, where it has a way to say it: llama.cpp's `/props`
        (`modalities.vision`), Ollama's `/api/show` (`capabilities`), LM Studio's `/api/v0/models/<model>` (`type`
        "vlm"). None when none of them answers (OpenAI's own API does not say): the user's word stands. Each probe is
        bounded like a model list (`limits.probe_s`, `limits.list_bytes`); what comes back is checked as hostile."""
        root = self.server.url.removesuffix("/v1")
        model = self.server.model
        props = self._probe("GET", root + "/props")
        modalities = props.get("modalities") if isinstance(props, dict) else None
        if isinstance(modalities, dict) and isinstance(modalities.get("vision"), bool):
            return bool(modalities["vision"])
        shown = self._probe("POST", root + "/api/show", {"model": model})
        capabilities = shown.get("capabilities") if isinstance(shown, dict) else None
        if isinstance(capabilities, list) and all(isinstance(c, str) for c in capabilities):
            return "vision" in capabilities
        listed = self._probe("GET", root + "/api/v0/models/" + quote(model, safe=""))
        kind = listed.get("type") if isinstance(listed, dict) else None
        return {"vlm": True, "llm": False}.get(kind) if isinstance(kind, str) else None

    def _probe(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON a 200 answer holds, or None for anything else (an error, a page, a silent or oversized reply)."""
        deadline = time.monotonic() + self.limits.probe_s
        timeout = httpx.Timeout(self.limits.probe_s, connect=min(CONNECT_TIMEOUT_S, self.limits.probe_s))
        try:
            with self._http.stream(method, url, json=body, timeout=timeout) as response:
                if response.status_code != 200:
                    return None
                raw = _read_capped(response, self.limits.list_bytes, deadline)  # a license or template may be long
        except httpx.HTTPError:
            return None
        return _loads(raw) if raw is not None else None

    def stream_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[GenerationEvent]:
        """Stream the reply to `messages`; one event per text chunk, the last with `finish_reason`.

        Events carry no token ids (the server does not send them); `generated_tokens` counts chunks until the
        server's usage (when it sends one) gives the true counts on the final event.
        """
        s = settings.sampling
        body: dict[str, Any] = {
            "model": self.server.model,
            "messages": [dict(m) for m in messages],
            "max_tokens": settings.max_tokens,
            "temperature": 0.0 if s.is_greedy else s.temperature,
            "top_p": s.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if settings.stop:
            body["stop"] = list(settings.stop)[:4]
        if s.seed is not None:
            body["seed"] = s.seed
        t0 = time.perf_counter()
        lines: queue.Queue[object] = queue.Queue(QUEUED_LINES)
        done = threading.Event()  # the consumer left (stopped, failed or finished): the reader lets go of the stream
        reader = threading.Thread(target=self._read, args=(body, lines, done), name="remote-stream", daemon=True)
        reader.start()
        try:
            yield from self._events(self._lines(lines, time.monotonic()), t0, should_stop)
        finally:
            done.set()

    def _read(self, body: dict[str, Any], lines: queue.Queue[object], done: threading.Event) -> None:
        """On the reader thread: the response's lines into `lines`, then _END, or the one RemoteError."""

        def put(item: object) -> bool:
            while not done.is_set():
                try:
                    lines.put(item, timeout=STOP_POLL_S)
                    return True
                except queue.Full:
                    continue
            return False

        where = self.server.url
        try:
            with self._http.stream("POST", where + "/chat/completions", json=body) as response:
                if response.status_code != 200:
                    put(self._fail(response))
                    return
                kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                if kind == "text/html":
                    put(
                        RemoteError(
                            f"The server at {where} answered with a web page, not OpenAI's API; check the address."
                        )
                    )
                    return
                for line in self._capped_lines(response):
                    if not put(line):
                        return  # leaving the `with` closes the connection: the server cancels the generation
        except RemoteError as exc:
            put(exc)
            return
        except httpx.HTTPError as exc:
            put(self._unreachable(exc))
            return
        except Exception as exc:
            put(
                RemoteError(
                    f"The connection to the server at {self.server.url} failed ({type(exc).__name__}); try again."
                )
            )
            return
        put(_END)

    def _capped_lines(self, response: httpx.Response) -> Iterator[str]:
        """The body's lines (\\n, \\r\\n or \\r), refusing a line or a body past the limits before buffering it."""
        lim, where = self.limits, self.server.url
        pending = b""
        total = 0
        for chunk in response.iter_bytes():  # decoded: the caps hold for a compressed body too
            total += len(chunk)
            if total > lim.reply_bytes:
                raise RemoteError(
                    f"The server at {where} sent more than {format_bytes(lim.reply_bytes)} for one reply; it was cut off."
                )
            pending += chunk
            if b"\n" not in chunk and b"\r" not in chunk:  # no line ended: only the pending line grew
                if len(pending) > lim.line_bytes:
                    raise RemoteError(
                        f"The server at {where} sent a line longer than {format_bytes(lim.line_bytes)}; it is not OpenAI's streaming format."
                    )
                continue
            *complete, pending = pending.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
            if len(pending) > lim.line_bytes or any(len(line) > lim.line_bytes for line in complete):
                raise RemoteError(
                    f"The server at {where} sent a line longer than {format_bytes(lim.line_bytes)}; it is not OpenAI's streaming format."
                )
            for line in complete:
                yield self._text(line)
        if pending:
            yield self._text(pending)

    def _text(self, line: bytes) -> str:
        try:
            return line.decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteError(f"The server at {self.server.url} sent text that is not UTF-8.") from None

    def _lines(self, lines: queue.Queue[object], started: float) -> Iterator[str | None]:
        """The stream's lines as they come; None whenever it is silent for STOP_POLL_S, so Stop is seen at once.
        The first line must come within the first-byte deadline and the last within the whole reply's."""
        lim, first = self.limits, True
        while True:
            waited = time.monotonic() - started
            if first and waited > lim.first_byte_s:
                raise RemoteError(
                    f"The server at {self.server.url} did not start its reply within {lim.first_byte_s:g} s; it may be overloaded."
                )
            if waited > lim.reply_s:
                raise RemoteError(
                    f"The server at {self.server.url} did not finish its reply within {lim.reply_s:g} s; it was cut off."
                )
            try:
                item = lines.get(timeout=STOP_POLL_S)
            except queue.Empty:
                yield None
                continue
            first = False
            if item is _END:
                return
            if isinstance(item, RemoteError):
                raise item
            yield str(item)

    def _events(
        self, lines: Iterator[str | None], t0: float, should_stop: Callable[[], bool]
    ) -> Iterator[GenerationEvent]:
        n, prompt_tokens, t_first, reason, chunks = 0, 0, t0, None, 0

        def event(text: str, final: FinishReason | None, reasoning: str = "") -> GenerationEvent:
            now = time.perf_counter()
            rate = (n - 1) / (now - t_first) if n > 1 and now > t_first else 0.0
            return GenerationEvent(
                text, None, None, prompt_tokens, n, t_first - t0 if n else 0.0, rate, final, reasoning=reasoning
            )

        for line in lines:
            if should_stop():
                yield event("", FinishReason.CANCELLED)
                return
            if line is None or not line.startswith("data:"):
                continue  # SSE comments, event names, blank separators
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = self._parse(data)
            chunks += 1
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                prompt_tokens = _whole(usage.get("prompt_tokens")) or prompt_tokens
                n = _whole(usage.get("completion_tokens")) or n
            choices = chunk.get("choices") or []
            if not isinstance(choices, list):
                raise RemoteError(
                    f"The server at {self.server.url} sent a reply that is not OpenAI's streaming format."
                )
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta") or {}
                text = delta.get("content") if isinstance(delta, dict) else None
                # llama.cpp's and vLLM's `reasoning_content` (some servers say `reasoning`): the think block
                thought = (
                    (delta.get("reasoning_content") or delta.get("reasoning")) if isinstance(delta, dict) else None
                )
                reason = choice.get("finish_reason") or reason
                text = text if isinstance(text, str) else ""
                thought = thought if isinstance(thought, str) else ""
                if text or thought:
                    n += 1
                    if n == 1:
                        t_first = time.perf_counter()
                    # a lone surrogate (JSON's \\ud800) as "?"
                    yield event(
                        text.encode("utf-8", "replace").decode("utf-8"),
                        None,
                        thought.encode("utf-8", "replace").decode("utf-8"),
                    )
        if not chunks:  # a 200 with no event at all (an empty body, a page, plain text): not an empty answer
            raise RemoteError(
                f"The server at {self.server.url} sent no reply in OpenAI's streaming format; check the address."
            )
        yield event("", parse_finish_reason(reason))

    def _parse(self, data: str) -> dict[str, Any]:
        chunk = _loads(data)
        if not isinstance(chunk, dict):
            raise RemoteError(f"The server at {self.server.url} sent a reply that is not OpenAI's streaming format.")
        if "error" in chunk:
            err = chunk["error"]
            message = err.get("message") if isinstance(err, dict) else err
            raise RemoteError(f"The server at {self.server.url} stopped with an error: {_clause(str(message))}.")
        return chunk


CANNOT_SEE_IMAGES = (
    "This server's model cannot see images and this conversation shows pictures, so nothing was sent; if the model "
    "can, add the server again with “Sees images” ticked, or load a model that does, such as SmolVLM."
)


def data_url(picture: DecodedImage) -> str:
    """A picture as a `data:` URL of its own bytes, its type read from them."""
    return f"data:{media_type(picture.data)};base64,{base64.b64encode(picture.data).decode('ascii')}"


def wire_messages(messages: Sequence[Mapping[str, str]], images: Sequence[DecodedImage]) -> list[dict[str, Any]]:
    """The transcript as OpenAI messages: a user message with pictures becomes text and `image_url` parts in the
    order of its markers (the transcript's pictures are listed in that order, as engine.session.pictures keeps
    them); every other message is sent as it is. A marker without a picture left is the user's own text."""
    held = list(images)
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m["content"]
        n = content.count(IMAGE_TOKEN) if m["role"] == "user" else 0
        mine, held = held[:n], held[n:]
        if not mine:
            out.append(dict(m))
            continue
        parts: list[dict[str, Any]] = []
        text = ""
        for k, piece in enumerate(content.split(IMAGE_TOKEN)):
            if k and k <= len(mine):
                if text:
                    parts.append({"type": "text", "text": text})
                parts.append({"type": "image_url", "image_url": {"url": data_url(mine[k - 1])}})
                text = ""
            elif k:
                text += IMAGE_TOKEN
            text += piece
        if text:
            parts.append({"type": "text", "text": text})
        out.append({**m, "content": parts})
    return out


@dataclass
class RemoteSession:
    """A conversation with a remote model: the transcript only (the server keeps whatever memory it keeps) and its
    pictures, in the order of the transcript's markers."""

    client: RemoteClient
    messages: list[dict[str, str]] = field(default_factory=list)
    system_prompt: str = ""
    images: list[DecodedImage] = field(default_factory=list)

    def reset(self) -> None:
        self.messages = []
        self.images = []

    def save(self, path: str | Path) -> int:
        """Write the transcript and its pictures as a .spark file (no memory: the server's is not ours to save).
        Opened with a local model it restores as a transcript of another model, to be re-read; returns the size
        in bytes."""
        fingerprint = (
            "remote-" + hashlib.sha256(f"{self.client.server.url}\n{self.client.server.model}".encode()).hexdigest()
        )
        extra: dict[str, Any] = {"remote_url": self.client.server.url, "model": self.client.server.model}
        order, pictures = image_tensors(self.images)  # each picture once, by its hash
        if order:
            extra["images"] = order
        return save_session(
            path,
            fingerprint=fingerprint,
            tokenizer_hash=None,
            messages=[Message(m["role"], m["content"]) for m in self.messages],
            system_prompt=self.system_prompt,
            settings={},
            memory_state=({"kind": TRANSCRIPT_KIND}, pictures),
            pending_token=None,
            sampler_state=None,
            extra=extra,
            token_ids=[],
        )

    def chat(
        self,
        user_text: str,
        settings: GenerationSettings,
        should_stop: Callable[[], bool] = lambda: False,
        images: Sequence[DecodedImage] = (),
    ) -> Iterator[GenerationEvent]:
        """Append a user message and stream the reply (appended to `messages` as it arrives). `images`: pictures
        that go with the message, placed before its text as a local session places them; RemoteError, with nothing
        appended, when the server's model cannot see them."""
        self._check_pictures(len(images))
        placed = user_text.count(IMAGE_TOKEN)  # markers place the pictures, as in a local session
        if placed and not images and self.client.server.sees_images:
            raise RemoteError(f"The text holds {IMAGE_TOKEN}, which marks where a picture goes; attach one.")
        if placed and images and placed != len(images):
            raise RemoteError(f"The text places {placed} images but {len(images)} were given.")
        marked = user_text if placed == len(images) else IMAGE_TOKEN * len(images) + user_text
        self.messages.append({"role": "user", "content": marked})
        self.images += images
        return self._reply(settings, should_stop)

    def regenerate(
        self, settings: GenerationSettings, should_stop: Callable[[], bool] = lambda: False
    ) -> Iterator[GenerationEvent]:
        self._check_pictures(0)
        while self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        return self._reply(settings, should_stop)

    def _check_pictures(self, new: int) -> None:
        if (new or self.images) and not self.client.server.sees_images:
            raise RemoteError(CANNOT_SEE_IMAGES)

    def _reply(self, settings: GenerationSettings, should_stop: Callable[[], bool]) -> Iterator[GenerationEvent]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        sent = wire_messages(system + list(self.messages), self.images)
        reply = {"role": "assistant", "content": ""}
        self.messages.append(reply)
        try:
            for ev in self.client.stream_chat(sent, settings, should_stop):
                reply["content"] += ev.text
                yield ev
        finally:
            if not reply["content"]:
                self.messages.remove(reply)
