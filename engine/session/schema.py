"""A session file's metadata (everything but the memory state) checked field by field: nesting, text, numbers,
times, token ids, sampling settings and the sampler's state. Raises `SchemaError` like engine.memory.states.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch

from engine.generation.sampling import InvalidSamplingSettings, SamplingSettings
from engine.memory.values import SchemaError, finite_number
from engine.model.kv_types import KVType
from engine.session.types import ATTACHMENT_KINDS, AttachmentRecord, RecalledRecord

MAX_TOKEN_ID = 2**31 - 1
MAX_DEPTH = 32  # the deepest a session's JSON nests is ~5; deeper is a hostile file
MAX_TEXT = 64 * 1024 * 1024
MAX_ID_CHARS = 256  # versions, fingerprints, hashes
LATEST_TIME = 253402300799.0  # 9999-12-31: any later timestamp cannot be shown as a date
MAX_ATTACHMENTS = 32  # attachments per conversation (engine.documents.attach holds to it)
MAX_ATTACHMENT_TOKENS = 1 << 20  # engine.documents.capsule's limit per attachment
MAX_ATTACHMENT_NAME = 255
MAX_RECALLED = 4096  # passages replies drew on, kept with the conversation
MAX_RECALLED_TEXT = 20_000  # characters of one passage
MAX_LINE = 10**9
SAMPLER_STATE_BYTES = len(torch.Generator().get_state())  # the CPU generator's state (engine.generation.sampling)


def check_json_values(meta: Any) -> None:
    """Every value of the parsed metadata: nesting bounded, strings that encode as UTF-8 (no lone surrogates),
    numbers finite (the parser already refused NaN and Infinity; a huge exponent parses to inf)."""
    stack: list[tuple[Any, int]] = [(meta, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise SchemaError(f"has metadata nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, str):
            _encodable(value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise SchemaError("has a number that is not finite")
        elif isinstance(value, dict):
            for k, v in value.items():
                _encodable(k)
                stack.append((v, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError("has text that is not valid Unicode (a lone surrogate)") from None


def _meta_field(meta: Mapping[str, Any], key: str, kind: type) -> Any:
    value = meta.get(key, ...)
    if value is ... or not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise SchemaError(f"has a missing or malformed {key!r} field")
    return value


def _short_text(meta: Mapping[str, Any], key: str, optional: bool = False) -> str | None:
    value = meta.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > MAX_ID_CHARS:
        raise SchemaError(f"has a missing or malformed {key!r} field")
    return value


def timestamp(value: Any, what: str) -> float:
    t = finite_number(value)
    if t is None or not 0.0 <= t <= LATEST_TIME:
        raise SchemaError(f"has a malformed {what}")
    return t


def token_id(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKEN_ID:
        raise SchemaError(f"has a malformed {key!r} field")
    return value


def check_sampling(settings: dict[str, Any]) -> None:
    """settings["sampling"], when present: exactly SamplingSettings' fields, each of its type and range."""
    sampling = settings.get("sampling")
    if sampling is None:
        return
    if not isinstance(sampling, dict):
        raise SchemaError("has malformed sampling settings")
    kinds = {f.name: f.type for f in fields(SamplingSettings)}
    for key, value in sampling.items():
        kind = kinds.get(key)
        ok = kind is not None and (
            (kind == "float" and finite_number(value) is not None)
            or (kind == "int" and not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= MAX_TOKEN_ID)
            or (kind == "bool" and isinstance(value, bool))
            or (
                key == "seed"
                and (value is None or (not isinstance(value, bool) and isinstance(value, int) and 0 <= value < 2**64))
            )
        )
        if not ok:
            raise SchemaError(f"has a malformed sampling setting {key!r}")
    try:
        SamplingSettings(**sampling).validate()
    except InvalidSamplingSettings:
        raise SchemaError("has sampling settings out of range") from None


def check_sampler_state(value: Any) -> None:
    if value is None:
        return
    if (
        not isinstance(value, list)
        or len(value) != SAMPLER_STATE_BYTES
        or any(type(b) is not int or not 0 <= b <= 255 for b in value)
    ):
        raise SchemaError("has a malformed sampler state")
    try:  # the generator's own checks, on a scratch generator: what restore's set_state will do
        torch.Generator().set_state(torch.tensor(value, dtype=torch.uint8))
    except (RuntimeError, ValueError):
        raise SchemaError("has a damaged sampler state") from None


def check_session_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The current-version metadata checked field by field -> SessionData's fields (minus tensors; messages as
    (role, content, timestamp, reasoning) tuples). One line per field."""
    check_json_values(meta)
    messages = []
    for m in _meta_field(meta, "messages", list):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SchemaError("has a malformed message")
        ts = m.get("timestamp")
        reasoning = m.get("reasoning", "")  # added later: files without it are read as they were
        if not isinstance(reasoning, str):
            raise SchemaError("has a malformed message reasoning (not text)")
        when = None if ts is None else timestamp(ts, "message timestamp")
        messages.append((m["role"], m["content"], when, reasoning))
    system_prompt = meta.get("system_prompt")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise SchemaError("has a malformed 'system_prompt' field")
    settings = _meta_field(meta, "settings", dict)
    check_sampling(settings)
    check_sampler_state(meta.get("sampler_state"))
    extra = _meta_field(meta, "extra", dict)
    if not isinstance(extra.get("known_text", ""), str):
        raise SchemaError("has a malformed 'extra.known_text' field")
    pending = meta.get("pending_token")
    kv_type = meta.get("kv_type", KVType.F16.value)  # files from before KV types held fp16
    if not isinstance(kv_type, str) or kv_type not in {t.value for t in KVType}:
        shown = kv_type[:MAX_ID_CHARS] if isinstance(kv_type, str) else type(kv_type).__name__
        raise SchemaError(f"holds keys and values of a type this version does not know ({shown!r})")
    token_ids = [token_id(t, "token_ids") for t in _meta_field(meta, "token_ids", list)]
    return {
        "app_version": _short_text(meta, "app_version"),
        "fingerprint": _short_text(meta, "model_fingerprint"),
        "tokenizer_hash": _short_text(meta, "tokenizer_hash", optional=True),
        "created": timestamp(meta.get("created"), "'created' time"),
        "saved": timestamp(meta.get("saved"), "'saved' time"),
        "system_prompt": system_prompt,
        "messages": messages,
        "settings": settings,
        "token_ids": token_ids,
        "pending_token": None if pending is None else token_id(pending, "pending_token"),
        "sampler_state": meta.get("sampler_state"),
        "memory_meta": _meta_field(meta, "memory", dict),
        "extra": extra,
        "kv_type": kv_type,
        "attachments": check_attachments(extra.get("attachments", []), len(token_ids)),
        "recalled": check_recalled(extra.get("recalled", []), len(messages)),
    }


def check_recalled(raw: Any, messages: int) -> list[RecalledRecord]:
    """extra["recalled"]: at most MAX_RECALLED passages, each under one of the messages, with bounded text and lines."""
    if not isinstance(raw, list) or len(raw) > MAX_RECALLED:
        raise SchemaError("has a malformed 'extra.recalled' field")
    out = []
    for r in raw:
        if not isinstance(r, dict) or set(r) != {"message", "source", "page", "start", "end", "text"}:
            raise SchemaError("has a malformed recalled passage")
        i, source, page, start, end, text = (r[k] for k in ("message", "source", "page", "start", "end", "text"))
        if type(i) is not int or not 0 <= i < messages:
            raise SchemaError("keeps a recalled passage under a message it does not hold")
        if not isinstance(source, str) or not 0 < len(source) <= MAX_ATTACHMENT_NAME:
            raise SchemaError("names a recalled passage's source by something other than a short name")
        lines_ok = all(type(n) is int and 0 <= n <= MAX_LINE for n in (start, end)) and start <= end
        if not lines_ok or not (page is None or (type(page) is int and 0 < page <= MAX_LINE)):
            raise SchemaError(f"gives a passage of {source!r} lines or a page out of range")
        if not isinstance(text, str) or len(text) > MAX_RECALLED_TEXT:
            raise SchemaError(f"keeps a passage of {source!r} longer than {MAX_RECALLED_TEXT:,} characters")
        out.append(RecalledRecord(i, source, page, start, end, text))
    return out


def check_attachments(raw: Any, tokens: int) -> list[AttachmentRecord]:
    """extra["attachments"]: at most MAX_ATTACHMENTS records of known kind, a plain name (no folders, no control
    characters), a content address, a bounded token count and a point within the memory's tokens."""
    if not isinstance(raw, list):
        raise SchemaError("has a malformed 'extra.attachments' field")
    if len(raw) > MAX_ATTACHMENTS:
        raise SchemaError(f"names {len(raw)} attachments, more than the {MAX_ATTACHMENTS} a conversation holds")
    out = []
    for r in raw:
        if not isinstance(r, dict) or set(r) != {"kind", "name", "digest", "tokens", "at"}:
            raise SchemaError("has a malformed attachment record")
        name, digest, n, at = r["name"], r["digest"], r["tokens"], r["at"]
        if r["kind"] not in ATTACHMENT_KINDS:
            raise SchemaError("names an attachment of an unknown kind")
        if (
            not isinstance(name, str)
            or not 0 < len(name) <= MAX_ATTACHMENT_NAME
            or any(c in name for c in "/\\") or name in (".", "..")
            or any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in name)
        ):  # fmt: skip
            raise SchemaError("names an attachment by something other than a plain file name")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise SchemaError(f"names the attachment {name!r} by a malformed digest")
        if type(n) is not int or not 0 < n <= MAX_ATTACHMENT_TOKENS:
            raise SchemaError(f"says the attachment {name!r} is {n!r} tokens, beyond what one may be")
        if type(at) is not int or not 0 <= at <= tokens:
            raise SchemaError(f"attaches {name!r} at a point outside its memory")
        out.append(AttachmentRecord(r["kind"], name, digest, n, at))
    return out


def check_vocab(token_ids: list[int], pending: int | None, vocab: int) -> None:
    if any(t >= vocab for t in token_ids) or (pending is not None and pending >= vocab):
        raise SchemaError(f"holds token ids beyond this model's {vocab}-token vocabulary")
