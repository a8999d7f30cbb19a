"""The training corpus: documentation of the local Python standard library, built at training time.

Each top-level stdlib module is rendered by `render.py` in its own isolated interpreter (see there for why) with
a fixed hash seed and a minimal environment, so the text is the same on every machine running the same Python.
Modules whose import has side effects (opening a browser, printing, needing a display) are never imported.

Two kinds of documents come out:
- pages: pydoc's plain-text page of each module and public submodule (signatures + docstrings of everything);
- chat examples: for each documented public function/class, a user question and an assistant answer with its
  signature and docstring, in the chat template's format, so the bundled model has seen that format.

The held-out split is of WHOLE top-level modules (a package and all its submodules go together), chosen by a
hash of the name, so no page of an eval module is ever trained on and the split never depends on ordering.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import SparkError

RENDERER = Path(__file__).with_name("render.py")

# Imported for their side effects or needing a display / an interactive terminal; never imported at all.
SIDE_EFFECT_MODULES = frozenset(
    {"antigravity", "this", "tkinter", "turtle", "turtledemo", "idlelib", "test", "ensurepip", "pydoc_data", "lib2to3"}
)
RENDER_TIMEOUT_S = 120.0
HELD_OUT_PERCENT = 12


class CorpusError(SparkError):
    """The corpus could not be built."""


@dataclass
class Corpus:
    train_pages: dict[str, str] = field(default_factory=dict)  # module name -> pydoc text
    eval_pages: dict[str, str] = field(default_factory=dict)
    train_chats: list[tuple[str, str]] = field(default_factory=list)  # (question, answer)
    eval_modules: list[str] = field(default_factory=list)  # held-out top-level modules

    def digest(self) -> str:
        """Content hash: a resumed run checks it rebuilt the same corpus it started on."""
        h = hashlib.sha256()
        for name in sorted(self.train_pages):
            h.update(f"T{name}\0{self.train_pages[name]}\0".encode())
        for name in sorted(self.eval_pages):
            h.update(f"E{name}\0{self.eval_pages[name]}\0".encode())
        for q, a in self.train_chats:
            h.update(f"C{q}\0{a}\0".encode())
        return h.hexdigest()[:16]


def stdlib_top_modules() -> list[str]:
    """Public top-level stdlib modules of this interpreter, minus the ones with side effects."""
    return sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SIDE_EFFECT_MODULES)


def is_held_out(top: str) -> bool:
    return int(hashlib.sha256(top.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def render_module(top: str) -> dict[str, object]:
    """Pages and entries of one top-level module, from a fresh isolated interpreter (empty result on failure)."""
    env = {"PYTHONHASHSEED": "0", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PATH": os.defpath, "TERM": "dumb", "COLUMNS": "80"}
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
    return json.loads(proc.stdout.decode("utf-8"))


def chat_example(qualname: str, signature: str, doc: str) -> tuple[str, str]:
    short = qualname.rsplit(".", 1)[-1]
    return f"What does {qualname} do?", f"{short}{signature}\n\n{doc}"


def build_corpus(modules: list[str] | None = None, workers: int = 2) -> Corpus:
    """Render `modules` (default: the whole public stdlib) and split whole modules into train and held-out."""
    tops = stdlib_top_modules() if modules is None else sorted(modules)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(render_module, tops))
    corpus = Corpus()
    for top, result in zip(tops, results):
        pages: dict[str, str] = result["pages"]  # type: ignore[assignment]
        if not pages:
            continue
        held = is_held_out(top)
        if held:
            corpus.eval_modules.append(top)
        (corpus.eval_pages if held else corpus.train_pages).update(pages)
        if not held:
            corpus.train_chats.extend(chat_example(*e) for e in result["entries"])  # type: ignore[union-attr]
    if not corpus.train_pages:
        raise CorpusError("No standard-library module could be rendered; check that this Python has its standard library.")
    return corpus
