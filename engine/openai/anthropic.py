"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the same service: a request is
translated into the OpenAI chat request it means and checked by engine.openai.protocol (the same sampling bounds,
tool grammar and scheduler), and the reply is written back in Anthropic's shapes.

Read: `model`, `max_tokens` (required, as Anthropic requires it), `system` (a string or text blocks), `messages`
(user and assistant turns of a string or `text`, `tool_use`, `tool_result` and `thinking` blocks; a user turn's
`image` blocks with a `base64` source — PNG, JPEG, GIF or WebP — or a `url` source become OpenAI `image_url` parts,
so they meet the same limits, the same decoding and the same `--allow-image-urls` rule), `tools` (`name`, `description`, `input_schema`), `tool_choice` (`auto`, `any`, `tool` with its `name`,
`none`; `disable_parallel_tool_use`), `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `thinking`
(`enabled` or `between_tools` / `disabled` / `adaptive`: the model's thinking switch on / off / its default),
`output_config.format` (a JSON schema the reply is constrained to); `metadata`, `service_tier` and
`output_config.effort` are ignored. A forced tool
(`any`, `tool`) constrains the reply to calls whose input fits the tool's `input_schema`.

Written: the message (`thinking`, `text` and `tool_use` blocks, `stop_reason` end_turn / max_tokens / stop_sequence /
tool_use, `usage`), or its stream: `message_start`, then per block `content_block_start`, its deltas
(`thinking_delta` + `signature_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`, a `ping`,
`message_delta` (stop reason, output tokens) and `message_stop`. Errors are Anthropic's
`{"type": "error", "error": {"type", "message"}}` with the status. Thinking blocks carry an empty `signature`:
there is nothing to sign locally, and a block sent back is read as the turn's reasoning.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from engine.generation.batch import Completion
from engine.generation.loop import FinishReason, GenerationEvent
from engine.generation.reasoning import Think
from engine.openai import protocol
from engine.openai.errors import ApiError, bad_request
from engine.tools.calls import ToolCall, ToolCallReader, finish_with_calls, read_reply
from engine.vision.images import MAX_BASE64_CHARS, MAX_IMAGE_BYTES

MAX_STOP_SEQUENCES = 16
IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
MAX_TOP_K = 1 << 20
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(err: ApiError) -> dict[str, Any]:
    """Anthropic's error object for `err` (its status decides the type)."""
    kind = ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


@dataclass
class MessagesRequest:
    """An Anthropic request as the OpenAI one it means, plus what only Anthropic's reply needs."""

    chat: protocol.ParsedRequest
    stop_sequences: tuple[str, ...] = ()


# -- request -------------------------------------------------------------------------------------------------------


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as one text."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or a list of text blocks.", where)
    parts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            what = "a tool result's images are not read" if kind == "image" else "only text blocks"
            raise bad_request(f"{where}[{i}] is not a text block ({what}).", f"{where}[{i}]")
        parts.append(block["text"])
    return "".join(parts)


def _user_turn(content: Any, i: int) -> list[dict[str, Any]]:
    """A user turn: its tool results as OpenAI tool messages (first, as Anthropic orders them), then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise bad_request(f"messages[{i}].content must be a string or a non-empty list of blocks.", f"messages[{i}]")
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []  # OpenAI content parts: text and image_url
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where} needs the 'tool_use_id' it answers.", where)
            body = block.get("content", "")
            text = _text_blocks(body, f"{where}.content") if body is not None else ""
            if block.get("is_error") is True:
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), where)}})
        else:
            raise bad_request(f"{where} must be a text, image or tool_result block.", where)
    if not parts:
        return results
    if all(p["type"] == "text" for p in parts):
        return [*results, {"role": "user", "content": "".join(p["text"] for p in parts)}]
    return [*results, {"role": "user", "content": parts}]


def _image_url(source: Any, where: str) -> str:
    """An image block's source as the URL an OpenAI image_url part holds: a data: URL for base64 (its length checked
    before it is copied), the URL itself for a url source (fetched only where the server allows it)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    if kind != "base64":
        raise bad_request(f"{where} needs a 'source' of type base64 (with media_type and data) or url.", where)
    media, data = source.get("media_type"), source.get("data")
    if media not in IMAGE_MEDIA_TYPES:
        raise bad_request(f"{where}'s media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}.", where)
    if not isinstance(data, str):
        raise bad_request(f"{where}'s source needs its picture as a base64 'data' string.", where)
    if len(data) > MAX_BASE64_CHARS:
        raise bad_request(
            f"{where} is {len(data) // 1_000_000} MB of base64; the limit is {MAX_IMAGE_BYTES // 2**20} MB.", where
        )
    return f"data:{media};base64,{data}"


def _assistant_turn(content: Any, i: int) -> dict[str, Any]:
    """An assistant turn: its text, its tool uses as OpenAI tool calls, its thinking as `reasoning_content`."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad_request(f"messages[{i}].content must be a string or a list of blocks.", f"messages[{i}]")
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by another server: nothing here can read it
        elif kind == "tool_use":
            name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, dict):
                raise bad_request(f"{where} needs an 'id', a 'name' and an 'input' object.", where)
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}})
        else:
            raise bad_request(f"{where} must be a text, thinking or tool_use block.", where)
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    if thoughts:
        out["reasoning_content"] = "".join(thoughts)
    return out


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, Any, bool]:
    """Anthropic's `tools` and `tool_choice` as OpenAI's (tools, tool_choice, parallel_tool_calls)."""
    raw = body.get("tools")
    tools = None
    if raw is not None:
        if not isinstance(raw, list):
            raise bad_request("'tools' must be a list of tools.", "tools")
        tools = []
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
                raise bad_request(
                    f"tools[{i}] must be a tool with a 'name' and an 'input_schema' (server tools are not supported).",
                    f"tools[{i}]",
                )
            schema = t.get("input_schema")
            if not isinstance(schema, dict):
                raise bad_request(f"tools[{i}].input_schema must be a JSON schema object.", f"tools[{i}].input_schema")
            fn = {"name": t.get("name"), "description": t.get("description") or "", "parameters": schema}
            tools.append({"type": "function", "function": fn})
    choice_raw = body.get("tool_choice")
    if choice_raw is None:
        return tools, None, True
    kind = choice_raw.get("type") if isinstance(choice_raw, dict) else None
    parallel = not (isinstance(choice_raw, dict) and choice_raw.get("disable_parallel_tool_use") is True)
    if kind == "auto":
        return tools, "auto", parallel
    if kind == "any":
        return tools, "required", parallel
    if kind == "none":
        return tools, "none", parallel
    if kind == "tool":
        return tools, {"type": "function", "function": {"name": choice_raw.get("name")}}, parallel
    raise bad_request("'tool_choice' must be of type auto, any, tool (with a 'name') or none.", "tool_choice")


def _think(body: dict[str, Any]) -> Think:
    raw = body.get("thinking")
    if raw is None:
        return Think.AUTO
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "enabled":
        budget = raw.get("budget_tokens")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise bad_request("'thinking.budget_tokens' must be a whole number of tokens.", "thinking.budget_tokens")
        return Think.ON
    if kind == "disabled":
        return Think.OFF
    if kind == "between_tools":
        return Think.ON
    if kind == "adaptive":
        return Think.AUTO
    raise bad_request("'thinking' must be {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}.", "thinking")


def _stop_sequences(body: dict[str, Any]) -> tuple[str, ...]:
    raw = body.get("stop_sequences")
    if raw is None:
        return ()
    if (
        not isinstance(raw, list)
        or len(raw) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and len(s) <= protocol.MAX_STOP_CHARS for s in raw)
    ):
        raise bad_request(
            f"'stop_sequences' must be a list of at most {MAX_STOP_SEQUENCES} strings of at most "
            f"{protocol.MAX_STOP_CHARS} characters.",
            "stop_sequences",
        )
    return tuple(s for s in raw if s)


def openai_body(body: Any, *, counting: bool = False) -> dict[str, Any]:
    """The OpenAI chat request an Anthropic Messages request means (checked further by protocol.parse_chat)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    if not counting and body.get("max_tokens") is None:
        raise bad_request("'max_tokens' is required: the most tokens the reply may have.", "max_tokens")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list of user and assistant turns.", "messages")
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            messages += _user_turn(m.get("content"), i)
        elif role == "assistant":
            messages.append(_assistant_turn(m.get("content"), i))
        else:
            raise bad_request(f"messages[{i}] needs a 'role' of user or assistant.", f"messages[{i}].role")
    tools, choice, parallel = _tools(body)
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False)}
    for name in ("max_tokens", "temperature", "top_p"):
        if body.get(name) is not None:
            out[name] = body[name]
    t = out.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 1:  # Anthropic's range (OpenAI's is 0-2)
        raise bad_request("'temperature' must be from 0 to 1.", "temperature")
    if tools:
        out["tools"], out["parallel_tool_calls"] = tools, parallel
    if choice is not None:
        out["tool_choice"] = choice
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("'output_config' must be an object.", "output_config")
    fmt = (config or {}).get("format")
    if fmt is not None:  # structured output: constrained as OpenAI's json_schema response_format is
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad_request(
                "'output_config.format' must be {'type': 'json_schema', 'schema': {...}}.", "output_config.format"
            )
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return out


def parse_messages(body: Any, limits: protocol.Limits, *, counting: bool = False) -> MessagesRequest:
    """A Messages request checked and translated; ApiError (400, naming the field) when it cannot be served."""
    chat = protocol.parse_chat(openai_body(body, counting=counting), limits)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
            raise bad_request(f"'top_k' must be a whole number from 0 to {MAX_TOP_K}.", "top_k")
        chat.settings.sampling = replace(chat.settings.sampling, top_k=top_k)
    stops = _stop_sequences(body)
    chat.settings.stop = stops
    chat.settings.think = _think(body)
    return MessagesRequest(chat, stops)


# -- reply ---------------------------------------------------------------------------------------------------------


def new_id(kind: str = "msg") -> str:
    return f"{kind}_{uuid.uuid4().hex[:24]}"


def stop_details(c: Completion, stops: tuple[str, ...], raw_text: str, calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply; `raw_text` is its tokens' text, the stop string included."""
    if finish_with_calls(c.finish_reason, calls) is FinishReason.TOOL_CALLS:
        return "tool_use", None
    if c.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    found = [(raw_text.find(s), s) for s in stops if s in raw_text]
    if found:
        return "stop_sequence", min(found)[1]
    return "end_turn", None


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.id.replace("call_", "toolu_", 1),
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def usage(c: Completion) -> dict[str, Any]:
    return {
        "input_tokens": c.prompt_tokens,
        "output_tokens": len(c.tokens),
        "cache_read_input_tokens": c.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def message(rid: str, model: str, req: MessagesRequest, c: Completion, raw_text: str) -> dict[str, Any]:
    """The whole reply as Anthropic's message object."""
    spec = req.chat.tools
    reply = read_reply(c.text, spec) if spec is not None and spec.active else None
    content, calls = (reply.content, list(reply.calls)) if reply is not None else (c.text, [])
    blocks: list[dict[str, Any]] = []
    if c.reasoning:
        blocks.append({"type": "thinking", "thinking": c.reasoning, "signature": ""})
    if content or not calls:
        blocks.append({"type": "text", "text": content})
    blocks += [tool_use_block(call) for call in calls]
    reason, sequence = stop_details(c, req.stop_sequences, raw_text, bool(calls))
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(c),
    }


def sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class StreamWriter:
    """A reply's events in, Anthropic's stream events out. Each kind of content is a block: the thinking first,
    then text, each tool call a `tool_use` block whose input comes as one `input_json_delta` once the call is
    complete (the grammar guarantees it fits its schema; a partial call is never sent)."""

    def __init__(self, rid: str, model: str, req: MessagesRequest, prompt_tokens: int) -> None:
        self.rid, self.model, self.req = rid, model, req
        spec = req.chat.tools
        self.reader = ToolCallReader(spec) if spec is not None and spec.active else None
        self.index = -1  # the block open now (-1: none yet)
        self.kind: str | None = None
        self.calls = 0
        self.prompt_tokens = prompt_tokens

    def start(self) -> Iterator[str]:
        usage0 = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        shell: dict[str, Any] = {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage0,
        }
        yield sse("message_start", {"type": "message_start", "message": shell})
        yield sse("ping", {"type": "ping"})

    def _open(self, kind: str, block: dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        self.index += 1
        self.kind = kind
        yield sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def _close(self) -> Iterator[str]:
        if self.kind is None:
            return
        if self.kind == "thinking":
            delta = {"type": "signature_delta", "signature": ""}
            yield sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
        yield sse("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.kind = None

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def event(self, ev: GenerationEvent) -> Iterator[str]:
        if ev.reasoning:
            if self.kind != "thinking":
                yield from self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": ev.reasoning})
        text, calls = ev.text, list[ToolCall]()
        if self.reader is not None:
            text, calls = self.reader.push(ev.text)
            if ev.finish_reason is not None:
                text += self.reader.flush()
        if text:
            if self.kind != "text":
                yield from self._open("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": text})
        for call in calls:
            block = {**tool_use_block(call), "input": {}}
            yield from self._open("tool_use", block)
            yield self._delta({"type": "input_json_delta", "partial_json": call.arguments})
            self.calls += 1

    def end(self, c: Completion, raw_text: str) -> Iterator[str]:
        if self.index < 0:  # an empty reply still has its one (empty) text block
            yield from self._open("text", {"type": "text", "text": ""})
        yield from self._close()
        reason, sequence = stop_details(c, self.req.stop_sequences, raw_text, self.calls > 0)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield sse("message_delta", {"type": "message_delta", "delta": delta, "usage": {"output_tokens": len(c.tokens)}})
        yield sse("message_stop", {"type": "message_stop"})
