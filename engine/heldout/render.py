"""Render one stdlib module (and its public submodules) to documentation text, in an isolated interpreter.

Run by `engine.heldout.docs` as `python -S -P render.py MODULE` in a fresh process per top-level module: `-S`
keeps site-packages (and shims such as setuptools' distutils hack) off the path so only the standard library is
read, `-P` keeps the caller's folder off `sys.path`, and a crash or a side effect of one import (a module that
prints, opens a window, or hangs) cannot reach the trainer or the other modules. This file must import nothing
from `engine` for the same reason.

Prints one JSON object on stdout: {"pages": {module: pydoc text}, "entries": [[qualname, signature, doc], ...]}.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import pydoc
import re
import sys
import warnings

# Sections of pydoc's page that describe this machine (paths, sys.path, os.environ) or repeat boilerplate.
DROPPED_SECTIONS = {"DATA", "FILE", "MODULE REFERENCE"}
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def skip_submodule(name: str) -> bool:
    """Tests, private helpers and the hundreds of near-identical codec tables add noise, not documentation."""
    parts = name.split(".")[1:]
    return any(p.startswith("_") or p in ("test", "tests", "idle_test") or p.startswith("test_") for p in parts) or (
        name.startswith("encodings.") or name.startswith("lib2to3.fixes")
    )


def clean_page(text: str) -> str:
    """Drop machine-specific sections and object addresses so the corpus is the same on every machine."""
    out: list[str] = []
    keep = True
    for line in text.splitlines():
        if line and not line[0].isspace():
            keep = line.strip() not in DROPPED_SECTIONS
        if keep:
            out.append(ADDRESS.sub("", line.rstrip()))
    return "\n".join(out).strip() + "\n"


def entries(module: object, modname: str) -> list[list[str]]:
    """(qualname, signature, docstring) of the public functions, classes and methods defined in `module`."""
    found: list[list[str]] = []

    def add(qual: str, obj: object) -> None:
        doc = inspect.getdoc(obj)
        if not doc or len(doc) < 40:
            return
        try:
            sig = str(inspect.signature(obj))  # type: ignore[arg-type]  # any module attribute; a non-callable raises TypeError, caught below
        except (TypeError, ValueError):
            sig = ""
        found.append([qual, ADDRESS.sub("", sig), ADDRESS.sub("", doc)])

    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != modname:
            continue
        if inspect.isfunction(obj) or inspect.isbuiltin(obj):
            add(f"{modname}.{name}", obj)
        elif inspect.isclass(obj):
            add(f"{modname}.{name}", obj)
            for mname, member in sorted(vars(obj).items()):
                if not mname.startswith("_") and (inspect.isfunction(member) or inspect.ismethoddescriptor(member)):
                    add(f"{modname}.{name}.{mname}", member)
    return found


def render(top: str) -> dict[str, object]:
    pages: dict[str, str] = {}
    found: list[list[str]] = []
    names = [top]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            module = importlib.import_module(top)
        except BaseException:  # any failure (ImportError, SystemExit, platform checks) means "skip"
            return {"pages": {}, "entries": []}
        if hasattr(module, "__path__"):
            for info in pkgutil.walk_packages(module.__path__, prefix=top + ".", onerror=lambda _name: None):
                if not skip_submodule(info.name):
                    names.append(info.name)
        for name in sorted(set(names)):
            try:
                mod = importlib.import_module(name)
                text = pydoc.render_doc(mod, title="%s", renderer=pydoc.plaintext)  # type: ignore[attr-defined]  # pydoc has it; typeshed does not declare it
            except BaseException:  # a submodule that cannot load on this platform is skipped
                continue
            pages[name] = clean_page(text)
            found.extend(entries(mod, name))
    return {"pages": pages, "entries": found}


def main() -> None:
    warnings.simplefilter("ignore")
    sys.stdout.write(json.dumps(render(sys.argv[1]), sort_keys=True))


if __name__ == "__main__":
    main()
