"""The ASGI application (Starlette): OpenAI's routes over the served models (engine.openai.pool: one loaded model,
or every servable model by name).

Routes: GET /health, GET /metrics, GET /v1/models[/{id}], POST /v1/chat/completions, POST /v1/completions,
OpenAI's files (POST, GET /v1/files, GET and DELETE /v1/files/{id}: engine.openai.files),
Ollama's POST /api/chat, /api/generate, /api/show, GET /api/tags, /api/ps (engine.openai.ollama), and Anthropic's
POST /v1/messages and /v1/messages/count_tokens (engine.openai.anthropic). Every failure is OpenAI's error object
with its status (see engine.openai.errors; Ollama's `{"error": ...}` and Anthropic's `{"type": "error", ...}` on
their routes); nothing else — no traceback, no HTML — ever reaches the client. The key is taken as `Authorization:
Bearer` or as Anthropic's `x-api-key`. A request holds a lease on its model until its reply is over. A client that
goes away (disconnect, or a failed send) cancels its request, so its row is free for the next one at the next
step. CORS is off unless origins are named.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from engine.errors import SparkError
from engine.generation.batch import Completion
from engine.generation.loop import GenerationEvent
from engine.generation.reasoning import reasoning_style
from engine.loading.tokenizer import Tokenizer
from engine.openai import anthropic, ollama, protocol
from engine.openai.errors import (
    CLIENT_CLOSED,
    ApiError,
    bad_key,
    bad_request,
    client_gone,
    server_error,
    too_large,
    unknown_model,
)
from engine.openai.files import PURPOSES, FileStore
from engine.openai.pool import Lease, ModelPool
from engine.openai.service import Job, ModelService
from engine.tools.calls import ToolCall, ToolCallReader, read_reply
from engine.tools.template import template_knows_tools
from engine.untrusted import JsonTooDeep, loads_bounded

log = logging.getLogger("engine.serve")
MULTIPART_SLACK = 64 * 1024  # an upload's form around its file: boundaries, headers, purpose
MAX_BODY_DEPTH = 256  # a request's JSON nests ~10 deep; a schema in it is held to 48 (engine.generation.constrained)
Handler = Callable[[Request], Awaitable[Response]]


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def ollama_error(err: ApiError) -> JSONResponse:
    return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)


def anthropic_error(err: ApiError) -> JSONResponse:
    return JSONResponse(anthropic.error_body(err), status_code=err.status, headers=err.headers)


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refusing (413) one over `limit` bytes before reading it all, (400) one that is not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(f"The request body is larger than the {limit:,} bytes this server accepts.")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(f"The request body is larger than the {limit:,} bytes this server accepts.")
    try:
        parsed = loads_bounded(bytes(body), max_bytes=limit, max_depth=MAX_BODY_DEPTH)
    except JsonTooDeep:
        raise bad_request(f"The request body nests deeper than {MAX_BODY_DEPTH} levels; flatten it.") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad_request("The request body is not valid JSON.") from None
    except ValueError:  # an integer literal past Python's int-string limit (4,300 digits)
        raise bad_request("The request body holds a number too long to be read.") from None
    protocol.check_text(parsed)
    return parsed


class SSEResponse(Response):
    """Server-sent events from `chunks`; a client disconnect (or a send that fails) cancels `jobs`."""

    media_type = "text/event-stream"

    def __init__(
        self,
        chunks: AsyncGenerator[str, None],
        jobs: list[Job],
        on_disconnect: Callable[[], None],
        content_type: bytes = b"text/event-stream; charset=utf-8",  # Ollama's route streams JSON lines instead
        on_close: Callable[[], None] = lambda: None,  # once the response is over, however it ended (a lease)
    ) -> None:
        self.status_code = 200
        self.background = None
        # No Content-Length: the body's length is unknown until the last event (chunked transfer).
        self.raw_headers = [
            (b"content-type", content_type),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.chunks, self.jobs, self.on_disconnect, self.on_close = chunks, jobs, on_disconnect, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:
                self.on_disconnect()
            self.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            finished = True
        except OSError:  # the client went away mid-send
            self.on_disconnect()
        finally:
            self.cancel()
            watcher.cancel()
            await self.chunks.aclose()
            self.on_close()

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel_unless_done()


def recalled(job: Job) -> list[dict[str, Any]]:
    """The extension field `recalled` of a reply that attached files: the passages its prompt drew on."""
    docs = job.documents
    return [c.to_dict() for c in docs.recalled] if docs is not None else []


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


T = TypeVar("T")


async def drain(job: Job) -> None:
    """Wait for a job's end, its events unread (a whole reply reads the job's result)."""
    async for _ in job.events():
        pass


async def run_watched(request: Request, jobs: list[Job], work: Awaitable[T]) -> T:
    """Await `work` over `jobs`; the client leaving meanwhile cancels them, and then nobody will read a reply:
    ClientGone (counted as a disconnect, not as the server's failure)."""
    gone = asyncio.Event()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()
        for job in jobs:
            job.cancel_unless_done()

    watcher = asyncio.create_task(watch())
    try:
        result = await work
    finally:
        watcher.cancel()
    if gone.is_set():
        raise client_gone()
    return result


class Api:
    """The route handlers, bound to the pool of served models and its metrics."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool
        self.config = pool.config
        self.metrics = pool.metrics
        self.created = int(time.time())
        self.files = FileStore(pool.config.files)

    # -- plumbing ----------------------------------------------------------------------------------------------
    def route(
        self,
        endpoint: str,
        handler: Handler,
        *,
        auth: bool = True,
        errors: Callable[[ApiError], JSONResponse] = error_response,
    ) -> Handler:
        async def wrapped(request: Request) -> Response:
            try:
                if auth:
                    self.check_key(request)
                response = await handler(request)
            except ApiError as err:
                response = errors(err)
                if err.status == CLIENT_CLOSED:
                    self.metrics.disconnected(endpoint)
            except Exception:  # a bug must not leak a traceback to the client; the log keeps it
                log.exception("request to %s failed", endpoint)
                response = errors(server_error("The server failed on this request; see its log."))
            self.metrics.request(endpoint, response.status_code)
            return response

        return wrapped

    def check_key(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        token = token or request.headers.get("x-api-key", "").strip()  # Anthropic's header
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise bad_key()

    def check_model(self, name: str) -> None:
        if name not in self.pool.servable:
            raise unknown_model(name, self.pool.names)

    def model_card(self, name: str) -> dict[str, Any]:
        """A servable model; `loaded` (ours, as LM Studio's): whether it is resident now."""
        loaded = self.pool.loaded(name)
        return {"id": name, "object": "model", "created": self.created, "owned_by": "mlot-spark", "loaded": loaded}

    async def lease(self, requested: str, keep_alive_s: float | bool | None = False) -> Lease:
        return await self.pool.acquire(requested, keep_alive_s)

    # -- routes ------------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        running = sum(r.service.scheduler.running for r in self.pool.residents.values())
        waiting = sum(r.service.scheduler.waiting for r in self.pool.residents.values())
        body = {"status": "ok", "model": self.config.model_id, "running": running, "waiting": waiting}
        return JSONResponse({**body, "loaded": list(self.pool.residents)})

    async def metrics_text(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card(n) for n in self.pool.names]})

    async def model(self, request: Request) -> Response:
        self.check_model(request.path_params["model"])
        return JSONResponse(self.model_card(request.path_params["model"]))

    async def chat(self, request: Request) -> Response:
        req = protocol.parse_chat(await read_json(request, self.config.max_body_bytes), self.config.limits)
        return await self.generate(request, req, chat=True)

    async def completions(self, request: Request) -> Response:
        req = protocol.parse_completion(await read_json(request, self.config.max_body_bytes), self.config.limits)
        return await self.generate(request, req, chat=False)

    async def ollama_chat(self, request: Request) -> Response:
        """Ollama's /api/chat: one choice, streamed as JSON lines unless `stream` is false."""
        t0 = time.perf_counter_ns()
        body = await read_json(request, self.config.max_body_bytes)
        return await self.ollama_reply(request, ollama.parse_chat(body, self.config.limits), body, t0, generate=False)

    async def ollama_generate(self, request: Request) -> Response:
        """Ollama's /api/generate: the prompt as the user's turn (as it is with `raw`); an empty prompt only loads
        the model (unloads it with `keep_alive` 0), as Ollama's does."""
        t0 = time.perf_counter_ns()
        body = await read_json(request, self.config.max_body_bytes)
        chat_body, raw = ollama.generate_body(body)
        if not chat_body["messages"][-1]["content"]:
            keep = ollama.keep_alive(body)
            lease = await self.lease(str(body.get("model") or ""), keep)
            lease.release()
            unload = keep is not False and keep == 0  # False: not sent (False == 0 in Python)
            if unload:
                await self.pool.unload(lease.name)
            reason = "unload" if unload else "load"
            done = {"model": lease.name, "created_at": ollama.now(), "response": "", "done": True}
            return JSONResponse({**done, "done_reason": reason})
        openai_body = ollama.openai_body(chat_body)
        if raw:
            prompt = chat_body["messages"][-1]["content"]
            openai_body = {k: v for k, v in openai_body.items() if k != "messages"} | {"prompt": prompt}
            req = protocol.parse_completion(openai_body, self.config.limits)
        else:
            req = protocol.parse_chat(openai_body, self.config.limits)
        return await self.ollama_reply(request, req, body, t0, generate=True)

    async def ollama_reply(
        self, request: Request, req: protocol.ParsedRequest, body: Any, t0: int, *, generate: bool
    ) -> Response:
        lease = await self.lease(req.model, ollama.keep_alive(body))
        req.model = lease.name
        try:
            jobs = await lease.service.start(req)
        except BaseException:
            lease.release()
            raise
        if req.stream:
            lines = self.ollama_lines(jobs[0], req.model, t0, generate)
            endpoint = "ollama_generate" if generate else "ollama_chat"
            disconnected = lambda: self.metrics.disconnected(endpoint)  # noqa: E731
            return SSEResponse(lines, jobs, disconnected, b"application/x-ndjson", lease.release)
        try:
            return await self.ollama_whole(request, req, jobs, t0, generate)
        finally:
            lease.release()

    async def ollama_whole(
        self, request: Request, req: protocol.ParsedRequest, jobs: list[Job], t0: int, generate: bool
    ) -> Response:
        await run_watched(request, jobs[:1], drain(jobs[0]))
        c = self.finish(jobs[0])
        shape = ollama.generate_final if generate else ollama.final
        return JSONResponse(shape(req.model, c, c.text, time.perf_counter_ns() - t0, c.reasoning))

    async def ollama_lines(self, job: Job, model: str, t0: int, generate: bool) -> AsyncGenerator[str, None]:
        piece = ollama.generate_chunk if generate else ollama.chunk
        async with contextlib.aclosing(job.events()) as events:
            async for ev in events:
                if ev.text or ev.reasoning:
                    yield json.dumps(piece(model, ev.text, ev.reasoning), ensure_ascii=False) + "\n"
        try:
            c = self.finish(job)
        except ApiError as err:  # the status line is gone already: the error travels as a line
            yield json.dumps({"error": err.message}) + "\n"
            return
        last = ollama.generate_final if generate else ollama.final
        yield json.dumps(last(model, c, "", time.perf_counter_ns() - t0)) + "\n"

    async def ollama_tags(self, request: Request) -> Response:
        """Ollama's /api/tags: every servable model."""
        models = [ollama.model_entry(s.name, s.size_bytes) for s in self.pool.servable.values()]
        return JSONResponse({"models": models})

    async def ollama_ps(self, request: Request) -> Response:
        """Ollama's /api/ps: the models resident now, and when each unloads for idleness."""
        models = []
        for name in self.pool.residents:
            servable = self.pool.servable.get(name)
            entry = ollama.model_entry(name, servable.size_bytes if servable else 0)
            models.append({**entry, "expires_at": ollama.expires_at(self.pool.expires_in(name)), "size_vram": 0})
        return JSONResponse({"models": models})

    async def ollama_show(self, request: Request) -> Response:
        """Ollama's /api/show: a model's chat template and capabilities, read without loading its weights."""
        body = await read_json(request, self.config.max_body_bytes)
        requested = (body.get("model") or body.get("name")) if isinstance(body, dict) else None
        if not isinstance(requested, str):
            raise bad_request("'model' must name a model (see GET /api/tags).", "model")
        name = self.pool.resolve(requested)
        resident = self.pool.residents.get(name)
        if resident is not None:
            template = resident.service.tokenizer.chat_template
        else:
            path = self.pool.servable[name].path
            try:
                template = (await asyncio.to_thread(Tokenizer.load, path)).chat_template if path else None
            except SparkError as exc:
                raise bad_request(str(exc), "model") from None
        capabilities = ["completion"]
        capabilities += ["tools"] if template_knows_tools(template) else []
        capabilities += ["thinking"] if reasoning_style(template).reasons else []
        return JSONResponse(ollama.show(name, template, capabilities, self.config.max_prompt_tokens))

    async def anthropic_messages(self, request: Request) -> Response:
        """Anthropic's /v1/messages (engine.openai.anthropic): one reply, streamed as its events when asked."""
        req = anthropic.parse_messages(await read_json(request, self.config.max_body_bytes), self.config.limits)
        chat = req.chat
        lease = await self.lease(chat.model)
        chat.model = lease.name
        try:
            jobs = await lease.service.start(chat)
        except BaseException:
            lease.release()
            raise
        rid = anthropic.new_id()
        if chat.stream:
            events = self.anthropic_events(jobs[0], req, rid, lease.service)
            disconnected = lambda: self.metrics.disconnected("anthropic_messages")  # noqa: E731
            return SSEResponse(events, jobs, disconnected, on_close=lease.release)
        try:
            return await self.anthropic_whole(request, req, jobs, rid, lease.service)
        finally:
            lease.release()

    async def anthropic_whole(
        self, request: Request, req: anthropic.MessagesRequest, jobs: list[Job], rid: str, service: ModelService
    ) -> Response:
        chat = req.chat
        await run_watched(request, jobs[:1], drain(jobs[0]))
        c = self.finish(jobs[0])
        raw = service.tokenizer.decode(c.tokens, skip_special=False)
        return JSONResponse(anthropic.message(rid, chat.model, req, c, raw))

    async def anthropic_events(
        self, job: Job, req: anthropic.MessagesRequest, rid: str, service: ModelService
    ) -> AsyncGenerator[str, None]:
        writer: anthropic.StreamWriter | None = None
        async with contextlib.aclosing(job.events()) as events:
            async for ev in events:
                if writer is None:
                    writer = anthropic.StreamWriter(rid, req.chat.model, req, ev.prompt_tokens)
                    for out in writer.start():
                        yield out
                for out in writer.event(ev):
                    yield out
        try:
            c = self.finish(job)
        except ApiError as err:  # the status line is gone already: the error travels as an event
            yield anthropic.sse("error", anthropic.error_body(err))
            return
        if writer is None:
            writer = anthropic.StreamWriter(rid, req.chat.model, req, c.prompt_tokens)
            for out in writer.start():
                yield out
        for out in writer.end(c, service.tokenizer.decode(c.tokens, skip_special=False)):
            yield out

    async def anthropic_count_tokens(self, request: Request) -> Response:
        """Anthropic's /v1/messages/count_tokens: the prompt's tokens as the chat template renders it."""
        body = await read_json(request, self.config.max_body_bytes)
        req = anthropic.parse_messages(body, self.config.limits, counting=True)
        lease = await self.lease(req.chat.model)
        try:
            ids = await asyncio.to_thread(lease.service.prompt_ids, req.chat)
        except SparkError as exc:
            raise bad_request(str(exc)) from None
        finally:
            lease.release()
        return JSONResponse({"input_tokens": len(ids)})

    # -- files (engine.openai.files) -----------------------------------------------------------------------------
    async def file_upload(self, request: Request) -> Response:
        """OpenAI's POST /v1/files: multipart `file` and `purpose`. The body is read within the upload limit first
        (declared length, then as it streams), so the form parser never sees more than that."""
        limit = self.config.files.max_file_bytes + MULTIPART_SLACK
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(f"The upload is larger than the {self.config.files.max_file_bytes:,} bytes a file may be.")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise bad_request("Upload a file as multipart/form-data with fields 'file' and 'purpose'.")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large(
                    f"The upload is larger than the {self.config.files.max_file_bytes:,} bytes a file may be."
                )
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        form_request = Request(request.scope, replay)
        try:
            form = await form_request.form(max_files=1, max_fields=4, max_part_size=4096)
        except HTTPException as exc:  # starlette's limits (too many parts, a field too large)
            raise bad_request(f"The upload's form is not accepted: {exc.detail}") from None
        except Exception:  # a malformed multipart body
            raise bad_request("The upload is not a readable multipart form.") from None
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(purpose, str) or not purpose:
                raise bad_request("'purpose' must name the file's purpose (e.g. \"user_data\").", "purpose")
            if purpose not in PURPOSES:
                raise bad_request(f"'purpose' must be one of {', '.join(PURPOSES)}.", "purpose")
            if upload is None or isinstance(upload, str):
                raise bad_request("'file' must be the uploaded file's part of the form.", "file")
            data = await upload.read()
            stored = await asyncio.to_thread(self.files.add, upload.filename, purpose, data)
        finally:
            await form.close()
        return JSONResponse(stored.as_openai())

    async def file_list(self, request: Request) -> Response:
        data = [f.as_openai() for f in self.files.listing()]
        return JSONResponse({"object": "list", "data": data, "has_more": False})

    async def file_get(self, request: Request) -> Response:
        return JSONResponse(self.files.get(request.path_params["file_id"]).as_openai())

    async def file_delete(self, request: Request) -> Response:
        stored = self.files.delete(request.path_params["file_id"])
        return JSONResponse({"id": stored.id, "object": "file", "deleted": True})

    # -- generation --------------------------------------------------------------------------------------------
    async def generate(self, request: Request, req: protocol.ParsedRequest, *, chat: bool) -> Response:
        # The model the request names (engine.openai.pool), loaded first when it is not resident; the reply names
        # the model that wrote it.
        # Unknown file ids fail before the model is leased; the files are read off the event loop.
        documents = [await asyncio.to_thread(self.files.document, f) for f in req.files] if chat else None
        lease = await self.lease(req.model)
        req.model = lease.name
        try:
            jobs = await lease.service.start(req, documents)
        except BaseException:
            lease.release()
            raise
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            endpoint = "chat" if chat else "completions"
            chunks = self.stream(jobs, req, rid, chat, lease.service)
            return SSEResponse(chunks, jobs, lambda: self.metrics.disconnected(endpoint), on_close=lease.release)
        try:
            return await self.whole(request, jobs, req, rid, chat, lease.service)
        finally:
            lease.release()

    def logprob(
        self, req: protocol.ParsedRequest, ev: GenerationEvent, service: ModelService
    ) -> protocol.TokenLogprob | None:
        if not req.logprobs or ev.token is None or ev.logprob is None:
            return None
        top = tuple((service.token_text(t), lp) for t, lp in ev.top_logprobs)
        return protocol.TokenLogprob(service.token_text(ev.token), ev.logprob, top)

    async def whole(
        self,
        request: Request,
        jobs: list[Job],
        req: protocol.ParsedRequest,
        rid: str,
        chat: bool,
        service: ModelService,
    ) -> Response:
        """A non-streaming reply; the client leaving while it waits cancels the jobs."""

        async def collect(job: Job) -> list[protocol.TokenLogprob]:
            entries = []
            async for ev in job.events():
                if (entry := self.logprob(req, ev, service)) is not None:
                    entries.append(entry)
            return entries

        logprobs = await run_watched(request, jobs, asyncio.gather(*(collect(job) for job in jobs)))
        cs = [self.finish(job) for job in jobs]
        choices = []
        for i, (c, lp) in enumerate(zip(cs, logprobs, strict=True)):
            if not chat:
                choices.append(protocol.completion_choice(i, c, lp if req.logprobs else None))
                continue
            reply = read_reply(c.text, req.tools) if req.tools and req.tools.active else None
            content, calls = (reply.content, list(reply.calls)) if reply is not None else (c.text, [])
            choice = protocol.chat_choice(i, c, lp if req.logprobs else None, content, calls)
            if jobs[i].documents is not None:
                choice["message"]["recalled"] = recalled(jobs[i])
            choices.append(choice)
        shape = protocol.chat_response if chat else protocol.completion_response
        return JSONResponse(shape(rid, req.model, choices, cs))

    async def stream(
        self, jobs: list[Job], req: protocol.ParsedRequest, rid: str, chat: bool, service: ModelService
    ) -> AsyncGenerator[str, None]:
        """Every choice's chunks as its events come (choices interleave, each chunk names its index), then each
        choice's final chunk, the usage and [DONE]. Tool calls go out as whole `tool_calls` deltas once each call's
        block has closed; the text around them as content."""
        created = int(time.time())
        model = req.model
        queue: asyncio.Queue[tuple[int, GenerationEvent | None]] = asyncio.Queue()

        async def pump(i: int, job: Job) -> None:
            async with contextlib.aclosing(job.events()) as events:
                async for ev in events:
                    await queue.put((i, ev))
            await queue.put((i, None))

        if chat:
            for i in range(len(jobs)):
                yield sse(protocol.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, index=i))
        readers = [ToolCallReader(req.tools) if chat and req.tools and req.tools.active else None for _ in jobs]
        offsets = [0] * len(jobs)
        calls = [0] * len(jobs)
        pumps = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            left = len(jobs)
            while left:
                i, ev = await queue.get()
                if ev is None:
                    left -= 1
                    continue
                entry = self.logprob(req, ev, service)
                lp = None
                if entry is not None:
                    lp = protocol.chat_logprobs([entry]) if chat else protocol.completion_logprobs([entry], offsets[i])
                text, new = ev.text, list[ToolCall]()
                reader = readers[i]
                if reader is not None:
                    text, new = reader.push(ev.text)
                    if ev.finish_reason is not None:
                        text += reader.flush()
                if chat and ev.reasoning:  # the think block, apart from the answer (llama.cpp's and vLLM's delta)
                    yield sse(protocol.chat_chunk(rid, model, created, {"reasoning_content": ev.reasoning}, index=i))
                if text or lp is not None:
                    offsets[i] += len(text)
                    yield sse(
                        protocol.chat_chunk(rid, model, created, {"content": text}, None, lp, i)
                        if chat
                        else protocol.completion_chunk(rid, model, created, text, None, lp, i)
                    )
                for call in new:
                    delta = {"tool_calls": [call.as_openai(calls[i])]}
                    calls[i] += 1
                    yield sse(protocol.chat_chunk(rid, model, created, delta, index=i))
        finally:
            for task in pumps:
                task.cancel()
        try:
            cs = [self.finish(job) for job in jobs]
        except ApiError as err:  # the status line is gone already: the error travels as an event
            yield sse(err.body())
            return
        for i, c in enumerate(cs):
            reason = protocol.finish_reason(c.finish_reason, calls[i] > 0)
            last: dict[str, Any] = {} if jobs[i].documents is None else {"recalled": recalled(jobs[i])}
            yield sse(
                protocol.chat_chunk(rid, model, created, last, reason, index=i)
                if chat
                else protocol.completion_chunk(rid, model, created, "", reason, index=i)
            )
        if req.include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield sse(protocol.usage_chunk(rid, model, created, obj, cs))
        yield "data: [DONE]\n\n"

    def finish(self, job: Job) -> Completion:
        try:
            c = job.result()
        except ApiError:  # the request's own problem found on the scheduler thread (e.g. a file that will not attach)
            raise
        except Exception as exc:  # the scheduler ended the request with an error (e.g. a failed forward)
            log.error("generation failed: %s", exc)
            raise server_error(f"Generation failed: {exc}") from None
        return c


def create_app(served: ModelService | ModelPool) -> Starlette:
    """The app over one loaded model, or over a pool of every servable model (engine.openai.pool)."""
    pool = served if isinstance(served, ModelPool) else ModelPool.single(served)
    api = Api(pool)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        what = "This method is not allowed here" if status == 405 else f"There is no route {request.url.path}"
        return error_response(ApiError(status, f"{what}; see /v1/models, /v1/chat/completions, /v1/completions."))

    routes = [
        Route("/health", api.route("health", api.health, auth=False), methods=["GET"]),
        Route("/metrics", api.route("metrics", api.metrics_text), methods=["GET"]),
        Route("/v1/models", api.route("models", api.models), methods=["GET"]),
        Route("/v1/models/{model:path}", api.route("models", api.model), methods=["GET"]),
        Route("/v1/chat/completions", api.route("chat", api.chat), methods=["POST"]),
        Route("/v1/completions", api.route("completions", api.completions), methods=["POST"]),
        Route("/v1/files", api.route("files", api.file_upload), methods=["POST"]),
        Route("/v1/files", api.route("files", api.file_list), methods=["GET"]),
        Route("/v1/files/{file_id}", api.route("files", api.file_get), methods=["GET"]),
        Route("/v1/files/{file_id}", api.route("files", api.file_delete), methods=["DELETE"]),
        Route("/api/chat", api.route("ollama_chat", api.ollama_chat, errors=ollama_error), methods=["POST"]),
        Route(
            "/api/generate", api.route("ollama_generate", api.ollama_generate, errors=ollama_error), methods=["POST"]
        ),
        Route("/api/tags", api.route("ollama_tags", api.ollama_tags, errors=ollama_error), methods=["GET"]),
        Route("/api/ps", api.route("ollama_ps", api.ollama_ps, errors=ollama_error), methods=["GET"]),
        Route("/api/show", api.route("ollama_show", api.ollama_show, errors=ollama_error), methods=["POST"]),
        Route(
            "/v1/messages",
            api.route("anthropic_messages", api.anthropic_messages, errors=anthropic_error),
            methods=["POST"],
        ),
        Route(
            "/v1/messages/count_tokens",
            api.route("anthropic_count_tokens", api.anthropic_count_tokens, errors=anthropic_error),
            methods=["POST"],
        ),
    ]
    middleware = []
    if pool.config.allow_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(pool.config.allow_origins),
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["*"],
            )
        )
    return Starlette(routes=routes, middleware=middleware, exception_handlers={404: not_found, 405: not_found})
