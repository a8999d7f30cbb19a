"""Ollama's `POST /api/chat` over the same service: a thin translation to and from the OpenAI request, so clients
written for Ollama (its own Python and JavaScript libraries, editors that speak only Ollama) get replies here.

Read: `model`, `messages` (role, content and `images`, base64 pictures placed before the text), `stream` (Ollama's default: true), `format`
("json", or a JSON schema: constrained as `response_format` is), and of `options` `temperature`, `num_predict`
(-1 or -2: the server's default budget), `top_p`, `seed`, `stop`; other options are ignored, as Ollama ignores the
ones a model does not use. The reply is one JSON object, or newline-delimited JSON chunks (`message.content`
pieces, then a last chunk with `done: true`, `done_reason` and the token counts). A failure is Ollama's
`{"error": message}` with its status.
"""

from __future__ import annotations

import datetime
from typing import Any

from engine.generation.batch import Completion
from engine.openai import protocol
from engine.openai.errors import bad_request

OPTIONS = {"temperature": "temperature", "num_predict": "max_tokens", "top_p": "top_p", "seed": "seed", "stop": "stop"}


def openai_body(body: Any) -> dict[str, Any]:
    """An Ollama chat request as the OpenAI chat request it means (checked further by protocol.parse_chat)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list of {'role': ..., 'content': ...}.", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with 'role' and 'content'.", f"messages[{i}]")
        images = m.get("images") or []
        if not isinstance(images, list) or not all(isinstance(b, str) for b in images):
            raise bad_request(f"messages[{i}].images must be a list of base64 strings.", f"messages[{i}].images")
        content = m.get("content", "")
        if images:  # OpenAI's image_url parts, pictures before the text as Ollama places them
            parts = [{"type": "image_url", "image_url": {"url": f"data:image/*;base64,{b}"}} for b in images]
            content = [*parts, {"type": "text", "text": content}] if isinstance(content, str) else content
        out.append({"role": m.get("role"), "content": content})
    stream = body.get("stream", True)  # Ollama streams unless told not to
    request: dict[str, Any] = {"model": body.get("model"), "messages": out, "stream": stream}
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad_request("'options' must be an object.", "options")
    for ours, theirs in OPTIONS.items():
        if options.get(ours) is not None:
            request[theirs] = options[ours]
    if request.get("max_tokens") in (-1, -2):  # Ollama's "no limit" / "fill the context": our default budget
        del request["max_tokens"]
    fmt = body.get("format")
    if fmt == "json":
        request["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_request("'format' must be \"json\" or a JSON schema object.", "format")
    return request


def parse_chat(body: Any, limits: protocol.Limits) -> protocol.ParsedRequest:
    return protocol.parse_chat(openai_body(body), limits)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def chunk(model: str, text: str) -> dict[str, Any]:
    """One streamed piece of the reply."""
    return {"model": model, "created_at": _now(), "message": {"role": "assistant", "content": text}, "done": False}


def final(model: str, c: Completion, text: str, total_ns: int) -> dict[str, Any]:
    """The last chunk of a stream (`text` ""), or the whole reply: the reason it ended and the counts."""
    decode_ns = int((len(c.tokens) - 1) / c.tokens_per_s * 1e9) if c.tokens_per_s > 0 and len(c.tokens) > 1 else 0
    return {
        "model": model,
        "created_at": _now(),
        "message": {"role": "assistant", "content": text},
        "done": True,
        "done_reason": protocol.finish_reason(c.finish_reason),
        "total_duration": total_ns,
        "prompt_eval_count": c.prompt_tokens,
        "prompt_eval_duration": int(c.ttft_s * 1e9),
        "eval_count": len(c.tokens),
        "eval_duration": decode_ns,
    }
