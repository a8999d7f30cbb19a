"""`python -m engine session inspect FILE [--json]` and `python -m engine session verify FILE`.

`verify` exits 0 only for a sound file this build can restore (SparkError -> exit 2 via engine.cli.main).
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path

from engine.session_file import inspect_session, verify_session

PREVIEW_CHARS = 72


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("session", help="inspect or verify a .spark session file")
    actions = parser.add_subparsers(dest="session_action", required=True, metavar="ACTION")
    inspect = actions.add_parser("inspect", help="show a session's messages, model, token count and sizes")
    inspect.add_argument("file", type=Path)
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(func=run_inspect)
    verify = actions.add_parser("verify", help="exit 0 only when the file is sound and this build can restore it")
    verify.add_argument("file", type=Path)
    verify.set_defaults(func=run_verify)


def _when(ts: float | None) -> str:
    return "unknown" if ts is None else datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="seconds")


def _preview(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= PREVIEW_CHARS else flat[: PREVIEW_CHARS - 1] + "…"


def run_inspect(args: argparse.Namespace) -> int:
    info = inspect_session(args.file)
    if args.json:
        print(json.dumps(info, ensure_ascii=False))
        return 0
    upgraded = "" if info["format_version"] == info["current_format_version"] else f" (read as v{info['current_format_version']})"
    lines = [
        f"{info['path']}",
        f"  format      v{info['format_version']}{upgraded}, saved by MLoT Spark {info['app_version']}",
        f"  model       {info['model_fingerprint']}",
        f"  tokenizer   {info['tokenizer_hash'] or 'unknown'}",
        f"  created     {_when(info['created'])}, saved {_when(info['saved'])}",
        f"  messages    {len(info['messages'])}, tokens {info['token_count']}",
        f"  memory      {info['memory_kind'] or 'unknown'}, compression {info['compression']}",
        f"  size        {info['file_bytes']} bytes on disk, " + ", ".join(f"{tier} {n} bytes" for tier, n in info["tier_bytes"].items()),
    ]
    if info["system_prompt"]:
        lines.append(f"  system      {_preview(info['system_prompt'])}")
    lines += [f"  {m['role']:>9}: {_preview(m['content'])}" for m in info["messages"]]
    print("\n".join(lines))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    data = verify_session(args.file)
    print(
        f"ok: {args.file} is a sound session (format v{data.format_version}, {len(data.messages)} messages, "
        f"{len(data.token_ids) + (data.pending_token is not None)} tokens, model {data.fingerprint[:12]})."
    )
    return 0
