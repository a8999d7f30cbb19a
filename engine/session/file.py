"""`.spark` session files: one conversation and its memory in one self-checking file (docs/DESIGN.md, "Session files").

This module reads, verifies and restores them, and is where callers import the whole API from:

- engine.session.container: the byte layout (preamble, checksum, compression, tensor table) and its limits;
- engine.session.types: what a file holds once read (`SessionData`, `Message`) and what restoring gives;
- engine.session.save: writing (`save_session`);
- engine.memory.states and engine.session.schema: every value checked before anything is allocated.

Older format versions stay readable: their metadata is migrated (`_MIGRATIONS`) in a chain up to
`FORMAT_VERSION`. v1's metadata had no tokenizer hash, no `saved` time and no `extra`, messages carried no
timestamps, and the sampler state was called `rng`.

Reading checks the container (session_container.read_checked) before anything is parsed; only then is the JSON
parsed, migrated and checked field by field, and the tensor table validated against its section before
safetensors decodes it. Every failure is one `SessionFileError` sentence; nothing is applied.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from engine.backends.base import Backend
from engine.errors import SessionFileError, SparkError
from engine.fileio import reject_constant
from engine.memory.base import Memory
from engine.memory.states import SchemaError, StateTarget, check_memory_state, target_from_state
from engine.session.container import (
    FORMAT_VERSION,
    MAGIC,
    MAX_FILE_BYTES,
    MAX_META_BYTES,
    MAX_TENSORS,
    SESSION_SUFFIX,
    Preamble,
    bad,
    decode_tensors,
    decompress,
    read_checked,
    tensor_table,
)
from engine.session.pictures import split_images
from engine.session.save import remove_stale_temps, save_session
from engine.session.schema import check_session_meta, check_vocab
from engine.session.types import (
    RECOMPUTE_KIND,
    TRANSCRIPT_KIND,
    AttachmentRecord,
    ForeignModelSession,
    JSONValue,
    Message,
    RestoredSession,
    SessionData,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_FILE_BYTES",
    "MAX_META_BYTES",
    "MAX_TENSORS",
    "RECOMPUTE_KIND",
    "SESSION_SUFFIX",
    "TRANSCRIPT_KIND",
    "AttachmentRecord",
    "ForeignModelSession",
    "JSONValue",
    "Message",
    "RestoredSession",
    "SessionData",
    "inspect_session",
    "load_session",
    "remove_stale_temps",
    "restore",
    "save_session",
    "session_fields",
    "tier_of",
    "verify_session",
]


# -- reading -------------------------------------------------------------------------------------------------------


def _migrate_v1_to_v2(meta: dict[str, JSONValue]) -> dict[str, JSONValue]:
    # Written so it cannot raise on any JSON object: whatever it leaves malformed, check_session_meta names.
    out = dict(meta)
    out["format_version"] = 2
    out["sampler_state"] = out.pop("rng", None)
    out["tokenizer_hash"] = None
    out["saved"] = out.get("created")
    out["extra"] = {}
    messages = out.get("messages")
    if isinstance(messages, list):
        out["messages"] = [{**m, "timestamp": None} if isinstance(m, dict) else m for m in messages]
    return out


_MIGRATIONS: dict[int, Callable[[dict[str, JSONValue]], dict[str, JSONValue]]] = {1: _migrate_v1_to_v2}


def _parse_meta(path: Path, pre: Preamble, raw: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(raw.decode("utf-8"), parse_constant=reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad(path, "has unreadable metadata (not strict JSON)") from None
    if not isinstance(meta, dict) or meta.get("format_version") != pre.version:
        raise bad(path, "has metadata that does not match its header")
    version = pre.version
    while version < FORMAT_VERSION:
        meta = _MIGRATIONS[version](meta)
        version += 1
    try:
        fields = check_session_meta(meta)
    except SchemaError as exc:
        raise bad(path, str(exc)) from None
    fields["messages"] = [Message(*m) for m in fields["messages"]]
    return fields


def _open(path: Path) -> tuple[Preamble, dict[str, Any], bytes, int]:
    """Checked preamble, validated metadata fields, the decompressed tensor section, the file size."""
    pre, meta_raw, stored, size = read_checked(path)
    fields = _parse_meta(path, pre, meta_raw)
    section = decompress(path, pre, stored)
    return pre, fields, section, size


def session_fields(path: Path, pre: Preamble, raw: bytes) -> dict[str, Any]:
    """A `.spark` file's metadata `raw` (after `container.read_layout`) as checked fields, its tensors left unread:
    for a reader that reads and checks the tensors itself (engine.session.kept reads its entries' blocks when
    first needed)."""
    return _parse_meta(path, pre, raw)


def load_session(path: str | Path, target: StateTarget | None = None) -> SessionData:
    """Read, verify and migrate a `.spark` file; raises SessionFileError naming the problem.

    The memory state is checked against `target` (the model's: exactly what `restore` checks), or without one
    against the file's own geometry (every check that does not need the model)."""
    path = Path(path).expanduser()
    pre, fields, section, size = _open(path)
    tensors = decode_tensors(path, section)
    try:
        images, tensors = split_images(fields["extra"], tensors)
        if target is not None:
            check_vocab(fields["token_ids"], fields["pending_token"], target.vocab_size)
        kind = fields["memory_meta"].get("kind")
        if kind == RECOMPUTE_KIND:
            _check_recipe(fields, tensors)
        elif kind == TRANSCRIPT_KIND:
            if tensors or fields["token_ids"] or fields["pending_token"] is not None:
                raise SchemaError("is a transcript-only file yet holds memory (tensors or token ids)")
        else:
            check_memory_state(
                fields["memory_meta"], tensors, target or target_from_state(fields["memory_meta"], tensors)
            )
    except SchemaError as exc:
        raise bad(path, str(exc)) from None
    return SessionData(
        format_version=pre.version,
        tensors=tensors,
        compression=pre.compression,
        file_bytes=size,
        images=images,
        **fields,
    )


def _check_recipe(fields: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """A compact file (engine.session.replay): no tensors, and a feed recipe that accounts for exactly its tokens."""
    # The recipe's one checker; imported here because engine.session.replay imports generation code.
    from engine.session.replay import check_schedule

    if tensors:
        raise SchemaError("is compact (memory recomputed on open) yet holds memory tensors")
    extra = fields.get("extra")
    try:
        check_schedule(extra.get("feed_schedule") if isinstance(extra, dict) else None, len(fields["token_ids"]))
    except SessionFileError:
        raise SchemaError("has a malformed memory recipe (its feed schedule does not account for its tokens)") from None


def verify_session(path: str | Path, target: StateTarget | None = None, fingerprint: str | None = None) -> SessionData:
    """`restore`'s checks without restoring: with the model's `target` and `fingerprint`, passing means restore
    succeeds. A file of another model (fingerprint differs) is checked as restore treats it: transcript only."""
    if target is not None and fingerprint is not None and load_session(path).fingerprint != fingerprint:
        target = None
    return load_session(path, target)


# Tensor-name prefixes of the memories' state() (engine.memory.cascade: "wk.k", "ep.12.v", "route.prompt_sum").
_TIER_PREFIXES = {"wk": "working", "working": "working", "ep": "episodic", "episodic": "episodic"}


def tier_of(tensor_name: str) -> str:
    """The tier a state tensor belongs to, by name prefix; bare names (FullAttentionMemory's "k", "v") are working
    memory, unknown prefixes are reported under their own name."""
    if "." not in tensor_name:
        return "working"
    prefix = tensor_name.split(".", 1)[0]
    return _TIER_PREFIXES.get(prefix, prefix)


def inspect_session(path: str | Path) -> dict[str, JSONValue]:
    """A verified summary for `session inspect` (JSON-able): version, model, messages, tokens, sizes per tier."""
    path = Path(path).expanduser()
    pre, fields, section, size = _open(path)
    table = tensor_table(path, section)
    tiers: dict[str, int] = {}
    for name, entry in table.items():
        tiers[tier_of(name)] = tiers.get(tier_of(name), 0) + entry.nbytes
    return {
        "path": str(path),
        "format_version": pre.version,
        "current_format_version": FORMAT_VERSION,
        "app_version": fields["app_version"],
        "model_fingerprint": fields["fingerprint"],
        "kv_type": fields["kv_type"],
        "tokenizer_hash": fields["tokenizer_hash"],
        "created": fields["created"],
        "saved": fields["saved"],
        "system_prompt": fields["system_prompt"],
        "messages": [
            {"role": m.role, "content": m.content, "timestamp": m.timestamp}
            | ({"reasoning": m.reasoning} if m.reasoning else {})
            for m in fields["messages"]
        ],
        "token_count": len(fields["token_ids"]) + (fields["pending_token"] is not None),
        "pending_token": fields["pending_token"],
        "memory_kind": fields["memory_meta"].get("kind"),
        "attachments": [a.to_json() for a in fields["attachments"]],
        "settings": fields["settings"],
        "compression": pre.compression,
        "file_bytes": size,
        "tensor_bytes": sum(tiers.values()),
        "tier_bytes": tiers,
    }


# -- restoring -----------------------------------------------------------------------------------------------------


def restore(
    path: str | Path,
    backend: Backend,
    memory_factory: Callable[[Backend], Memory],
    *,
    tokenizer_hash: str | None = None,
    recompute: Callable[[Memory, SessionData], None] | None = None,
) -> RestoredSession | ForeignModelSession:
    """Verify `path`, then write its memory back through a new `memory_factory(backend)`.

    Returns ForeignModelSession (applying nothing) when the file was made with another model or tokenizer.
    Every check (session_schema, against the new memory's `state_target()`) runs before anything is written, so
    on any SessionFileError the backend is untouched.
    Give a factory over a row (or forked backend) the current conversation does not use to keep it intact.
    A compact file (memory kind "recompute": no KV, see engine.session.replay) is rebuilt by `recompute(memory, data)`.
    """
    path = Path(path).expanduser()
    data = load_session(path)
    if data.fingerprint != backend.fingerprint:
        return ForeignModelSession(
            data,
            f"{path.name} was saved with a different model ({data.fingerprint[:12]}, this one is {backend.fingerprint[:12]}); "
            "its transcript can be restored and re-read, but not its memory.",
        )
    if tokenizer_hash is not None and data.tokenizer_hash is not None and data.tokenizer_hash != tokenizer_hash:
        return ForeignModelSession(
            data,
            f"{path.name} was saved with a different tokenizer; its transcript can be restored and re-read, but not its memory.",
        )
    if data.kv_type != backend.kv_type.value:  # same values would continue on other numerics: not this memory
        return ForeignModelSession(
            data,
            f"{path.name} was saved with {data.kv_type} keys and values, and this engine holds "
            f"{backend.kv_type.value}; its transcript can be restored and re-read, but not its memory.",
        )
    memory = memory_factory(backend)
    if data.memory_meta.get("kind") == RECOMPUTE_KIND:
        # Checked by load_session (no tensors, a recipe for exactly its tokens); the tokens against the vocabulary here.
        try:
            check_vocab(data.token_ids, data.pending_token, memory.state_target().vocab_size)
        except SchemaError as exc:
            raise bad(path, str(exc)) from None
        if recompute is None:
            raise SessionFileError(
                f"The session {path.name} is compact and must be opened by the app or the engine, which recompute its memory."
            )
        try:
            recompute(memory, data)
        except BaseException:
            memory.reset()
            raise
        return RestoredSession(data, memory)
    # The memory is made (sized by the model, never by the file) only to learn its geometry; it is checked against
    # before anything is written, so a refused file leaves it and the backend untouched.
    try:
        target = memory.state_target()
        check_vocab(data.token_ids, data.pending_token, target.vocab_size)
        check_memory_state(data.memory_meta, data.tensors, target)
    except SchemaError as exc:
        raise bad(path, str(exc)) from None
    try:
        memory.load_state(data.memory_meta, data.tensors)
    except SparkError as exc:
        memory.reset()
        raise SessionFileError(f"The session {path.name} cannot be restored here: {exc}") from None
    return RestoredSession(data, memory)
