"""Long documents for the perplexity benchmark: the local Python standard library's pydoc pages.

Each top-level stdlib module is rendered by `render.py` in its own isolated interpreter (see there for why)
with a fixed hash seed and a minimal environment, so the text is the same on every machine running the same
Python. Modules whose import has side effects (opening a browser, printing, needing a display) are never imported.
`is_sampled` picks a fixed subset of modules by a hash of the name, so the document never depends on ordering.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

RENDERER = Path(__file__).with_name("render.py")

# Imported for their side effects or needing a display / an interactive terminal; never imported at all.
SIDE_EFFECT_MODULES = frozenset(
    {"antigravity", "this", "tkinter", "turtle", "turtledemo", "idlelib", "test", "ensurepip", "pydoc_data", "lib2to3"}
)
RENDER_TIMEOUT_S = 120.0
SAMPLED_PERCENT = 12


def stdlib_top_modules() -> list[str]:
    """Public top-level stdlib modules of this interpreter, minus the ones with side effects."""
    return sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SIDE_EFFECT_MODULES)


def is_sampled(top: str) -> bool:
    return int(hashlib.sha256(top.encode()).hexdigest(), 16) % 100 < SAMPLED_PERCENT


def render_module(top: str) -> dict[str, object]:
    """Pages and entries of one top-level module, from a fresh isolated interpreter (empty result on failure)."""
    env = {
        "PYTHONHASHSEED": "0",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PATH": os.defpath,
        "TERM": "dumb",
        "COLUMNS": "80",
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-S", "-P", str(RENDERER), top],
            capture_output=True,
            env=env,
            stdin=subprocess.DEVNULL,
            timeout=RENDER_TIMEOUT_S,
            cwd=RENDERER.parent,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"pages": {}, "entries": []}
    if proc.returncode != 0:
        return {"pages": {}, "entries": []}
    docs: dict[str, object] = json.loads(proc.stdout.decode("utf-8"))
    return docs


def held_out_text(min_chars: int) -> str:
    """Pages of the sampled stdlib modules until there is enough."""
    names = [m for m in stdlib_top_modules() if is_sampled(m)]
    text = ""
    for name in names:
        pages = render_module(name)["pages"]
        if not isinstance(pages, dict):  # the renderer's JSON: {"pages": {title: text}}
            continue
        text += "".join(pages[k] + "\n\n" for k in sorted(pages))
        if len(text) >= min_chars:
            break
    return text
