"""Writing a `.spark` file: the conversation and its memory as current-version metadata + tensors, saved atomically.

The write is engine.fileio's (temp file in the same folder, fsync, `os.replace`, fsync of the folder), so a crash
or a full disk mid-save leaves the previous file as it was. Only a regular file (or nothing) is ever replaced,
never what a link points at; temp files of killed saves are removed on the next save.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Mapping, Sequence
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from engine.errors import SessionFileError
from engine.fileio import SYSTEM, FileSystem
from engine.fileio import atomic_write as durable_write
from engine.session.container import FORMAT_VERSION, MAX_META_BYTES, MAX_TENSORS, pack
from engine.session.types import JSONValue, Message
from engine.version import __version__

STALE_TEMP_S = 3600.0  # a temp file older than this belongs to no running save


def _message_json(m: Message | Mapping[str, Any] | Any) -> dict[str, JSONValue]:
    # Accepts engine.session.types.Message, engine.session.engine.ChatMessage (same attributes) or a plain mapping.
    get = m.get if isinstance(m, Mapping) else lambda k, d=None: getattr(m, k, d)
    ts = get("timestamp")
    out: dict[str, JSONValue] = {
        "role": str(get("role")),
        "content": str(get("content")),
        "timestamp": None if ts is None else float(ts),
    }
    reasoning = get("reasoning") or ""
    if reasoning:  # kept apart from the answer; a file without reasoning stays as older versions wrote it
        out["reasoning"] = str(reasoning)
    return out


def _host_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous host tensors, none sharing memory (safetensors refuses that, e.g. one zero tensor used twice)."""
    host: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        host[name] = t
    return host


def save_session(
    path: str | Path,
    *,
    fingerprint: str,
    tokenizer_hash: str | None,
    messages: Sequence[Message | Mapping[str, Any] | Any],
    system_prompt: str | None,
    settings: Mapping[str, JSONValue],
    memory_state: tuple[Mapping[str, JSONValue], Mapping[str, torch.Tensor]],
    pending_token: int | None,
    sampler_state: JSONValue,
    extra: Mapping[str, JSONValue] | None = None,
    token_ids: Sequence[int] | None = None,
    created: float | None = None,
    compression: str = "zlib",
    kv_type: str = "f16",
    fs: FileSystem = SYSTEM,
) -> int:
    """Atomically write a session file; returns its size in bytes.

    memory_state is `Memory.state()`; token_ids defaults to its meta's "tokens" (every token fed so far);
    pending_token is the last sampled token not yet fed; sampler_state the sampler's JSON-able RNG state;
    created is the conversation's first save time (kept across autosaves; now when None). compression: "zlib"
    (byte-shuffled, level 1: about a third smaller for real KV, fast), "lzma" (a little smaller, ~10x slower) or
    "none"; a codec that saves under 5% is dropped and the tensors stored raw. kv_type: what the slot table held
    keys and values in (engine.model.kv_types), so a restore continues on the same numerics.
    On failure (full disk, no permission) raises SessionFileError and the previous file is untouched.
    """
    memory_meta, tensors = memory_state
    if token_ids is None:
        token_ids = memory_meta.get("tokens", [])  # Memory.tokens, as FullAttentionMemory's state records it
    saved = time.time()
    meta = {
        "format_version": FORMAT_VERSION,
        "app_version": __version__,
        "model_fingerprint": fingerprint,
        "kv_type": kv_type,
        "tokenizer_hash": tokenizer_hash,
        "created": saved if created is None else created,
        "saved": saved,
        "system_prompt": system_prompt,
        "messages": [_message_json(m) for m in messages],
        "settings": dict(settings),
        "token_ids": [int(t) for t in token_ids],
        "pending_token": None if pending_token is None else int(pending_token),
        "sampler_state": sampler_state,
        "memory": dict(memory_meta),
        "extra": dict(extra or {}),
    }
    # allow_nan=False: NaN/Infinity are not JSON, and other readers of the file would choke on them.
    try:
        meta_bytes = json.dumps(meta, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        raise SessionFileError(
            "The conversation holds text that is not valid Unicode (a lone surrogate), so it cannot be saved."
        ) from None
    if len(meta_bytes) > MAX_META_BYTES:
        raise SessionFileError(
            f"The conversation's metadata is {len(meta_bytes)} bytes, over the {MAX_META_BYTES}-byte session limit, so it cannot be saved."
        )
    if len(tensors) > MAX_TENSORS:
        raise SessionFileError(
            f"The memory has {len(tensors)} tensors, over the {MAX_TENSORS} a session file holds, so it cannot be saved."
        )
    chunks = pack(meta_bytes, st_save(_host_copies(tensors)), compression)
    write_session_file(Path(path).expanduser(), chunks, fs=fs)
    return sum(map(len, chunks))


def _check_target(path: Path) -> None:
    """Saving replaces the file at `path`: only ever a regular file (or nothing), never what a link points at."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SessionFileError(f"Could not save the session to {path}: {exc.strerror or exc}.") from None
    if stat.S_ISDIR(st.st_mode):
        raise SessionFileError(f"{path} is a folder; choose a file name to save the session to.")
    kinds = (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    )
    for test, kind in kinds:
        if test(st.st_mode):
            raise SessionFileError(
                f"{path} is {kind}, not a regular file, so the session was not saved there; choose another file name."
            )


def _temp_prefix(name: str, pid: int | None = None) -> str:
    return f".{name}.{os.getpid() if pid is None else pid}."


def remove_stale_temps(path: Path) -> int:
    """Delete temp files that killed saves of `path` left behind: their writer is gone (same machine) or they are
    older than STALE_TEMP_S (a writer elsewhere). Returns how many were removed."""
    removed = 0
    try:
        candidates = list(path.parent.glob(f".{glob_escape(path.name)}.*.tmp"))
    except OSError:
        return 0
    for tmp in candidates:
        pid_text = tmp.name[len(path.name) + 2 :].split(".", 1)[0]
        try:
            st = os.lstat(tmp)
            dead = pid_text.isdigit() and not _alive(int(pid_text))
            if stat.S_ISREG(st.st_mode) and (dead or time.time() - st.st_mtime > STALE_TEMP_S):
                os.unlink(tmp)
                removed += 1
        except OSError:
            pass  # renamed or removed by its writer meanwhile
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process, or not a pid we can ask about: leave its file to the age rule
    return True


def write_session_file(path: Path, chunks: Sequence[bytes], fs: FileSystem = SYSTEM) -> None:
    """Write a session file's `chunks` to `path` durably (engine.fileio.atomic_write): old or new, never half.
    Refuses a target that is not a regular file; first removes temp files of earlier saves that were killed. Errors
    are one SessionFileError sentence."""
    _check_target(path)
    remove_stale_temps(path)
    try:
        durable_write(path, chunks, prefix=_temp_prefix(path.name), suffix=".tmp", fs=fs)
    except OSError as exc:
        raise SessionFileError(
            f"Could not save the session to {path}: {exc.strerror or exc}; the previous file (if any) is unchanged."
        ) from None
