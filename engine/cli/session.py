"""`python -m engine session inspect FILE [--json]` and `python -m engine session verify FILE`.

`verify` exits 0 only for a sound file this build can restore (SparkError -> exit 2 via engine.cli.main); with
`--model DIR` it runs exactly restore's checks against that model (verify OK => restore succeeds).

Everything printed from a file is escaped: control characters (ANSI/OSC sequences would clear the screen or set
the title), C1 controls, bidirectional overrides and surrogates come out as visible `\\xNN` / `\\uNNNN`.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from engine.session.file import inspect_session, verify_session

if TYPE_CHECKING:
    from engine.memory.values import StateTarget

PREVIEW_CHARS = 72
# What a terminal would act on or render deceptively: C0/C1 controls, DEL, bidi controls, surrogates.
_UNSAFE = (
    {c for c in range(0x20)}
    | set(range(0x7F, 0xA0))
    | set(range(0x202A, 0x202F))
    | set(range(0x2066, 0x206A))
    | {0x200E, 0x200F, 0x061C}
)
_ESCAPES = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNSAFE}
_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in _UNSAFE if c >= 0x20}  # json.dumps already escapes C0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("session", help="inspect or verify a .spark session file")
    actions = parser.add_subparsers(dest="session_action", required=True, metavar="ACTION")
    inspect = actions.add_parser("inspect", help="show a session's messages, model, token count and sizes")
    inspect.add_argument("file", type=Path)
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(func=run_inspect)
    verify = actions.add_parser("verify", help="exit 0 only when the file is sound and this build can restore it")
    verify.add_argument("file", type=Path)
    verify.add_argument(
        "--model",
        type=Path,
        default=None,
        help="run restore's checks against this model (folder or .gguf; default: the default model)",
    )
    verify.set_defaults(func=run_verify)


def escape(value: object) -> str:
    """`value` as text safe to print on a terminal (see the module docstring)."""
    return "".join(f"\\u{ord(c):04x}" if 0xD800 <= ord(c) < 0xE000 else c for c in str(value).translate(_ESCAPES))


def _when(ts: float | None) -> str:
    if ts is None:
        return "unknown"
    try:
        return datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return f"{ts:.0f} (out of range)"


def _preview(text: str) -> str:
    flat = " ".join(text.split())
    flat = flat if len(flat) <= PREVIEW_CHARS else flat[: PREVIEW_CHARS - 1] + "…"
    return escape(flat)


def run_inspect(args: argparse.Namespace) -> int:
    info = inspect_session(args.file)
    if args.json:
        text = json.dumps(info, ensure_ascii=False).translate(_JSON_ESCAPES)
        print(text.encode("utf-8", "backslashreplace").decode("utf-8"))
        return 0
    upgraded = (
        ""
        if info["format_version"] == info["current_format_version"]
        else f" (read as v{info['current_format_version']})"
    )
    lines = [
        f"{escape(info['path'])}",
        f"  format      v{info['format_version']}{upgraded}, saved by MLoT Spark {escape(info['app_version'])}",
        f"  model       {escape(info['model_fingerprint'])}",
        f"  tokenizer   {escape(info['tokenizer_hash'] or 'unknown')}",
        f"  created     {_when(info['created'])}, saved {_when(info['saved'])}",
        f"  messages    {len(info['messages'])}, tokens {info['token_count']}",
        f"  memory      {escape(info['memory_kind'] or 'unknown')}, compression {info['compression']}",
        f"  size        {info['file_bytes']} bytes on disk, "
        + ", ".join(f"{escape(tier)} {n} bytes" for tier, n in info["tier_bytes"].items()),
    ]
    if info["system_prompt"]:
        lines.append(f"  system      {_preview(info['system_prompt'])}")
    lines += [f"  {_preview(m['role']):>9}: {_preview(m['content'])}" for m in info["messages"]]
    print("\n".join(lines))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    model = args.model if args.model is not None else _installed_default_model()
    target, fingerprint = (None, None) if model is None else _model_target(model)
    data = verify_session(args.file, target, fingerprint)
    ours = fingerprint is not None and data.fingerprint == fingerprint
    scope = "restores on this model" if ours else "transcript only on this model" if fingerprint else "file checks"
    print(
        f"ok: {escape(args.file)} is a sound session ({scope}; format v{data.format_version}, {len(data.messages)} messages, "
        f"{len(data.token_ids) + (data.pending_token is not None)} tokens, model {escape(data.fingerprint[:12])})."
    )
    return 0


def _installed_default_model() -> Path | None:
    """The default model, against which a plain `session verify` runs restore's checks; None when not installed."""
    from engine.errors import ModelLoadError
    from engine.loading.model_files import default_model_path

    try:
        return default_model_path()
    except ModelLoadError:
        return None


def _model_target(model_dir: Path) -> tuple[StateTarget, str]:
    """(the state target restore would use, the model's fingerprint), from the folder's config, cascade.json and
    weight headers alone: no weights are loaded."""
    from engine.loading.model_files import check_model_path, read_config, settings_dir
    from engine.loading.weights import model_fingerprint
    from engine.memory.cascade import CascadeConfig
    from engine.memory.values import StateTarget

    path = model_dir.expanduser()
    check_model_path(path)
    config = read_config(path)
    cascade = CascadeConfig.for_model(settings_dir(path), config)
    dims = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    target = StateTarget(config.id_limit, dims, cascade=cascade, max_positions=config.max_position_embeddings)
    return target, model_fingerprint(path)
