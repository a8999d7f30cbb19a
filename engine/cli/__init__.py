"""`python -m engine` — the command-line contract of docs/DESIGN.md.

Each subcommand is a module exposing `register(subparsers)` (adds its parser, sets `func`) and is listed
explicitly in `SUBCOMMANDS`: no dynamic discovery. Errors the user can act on (`SparkError`) print one line on
stderr and exit 2; nothing prints a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Callable, Sequence

from engine.errors import SparkError
from engine.untrusted import shown

MAX_ERROR_CHARS = 2000

# name -> module under engine.cli (imported lazily so `hw` never pays for torch-heavy imports it doesn't need)
SUBCOMMANDS: dict[str, str] = {
    "generate": "engine.cli.generate",
    "chat": "engine.cli.chat",
    "session": "engine.cli.session",
    "hw": "engine.cli.hw",
    "serve": "engine.cli.serve",
    "bench": "engine.cli.bench",
    "models": "engine.cli.models",
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="MLoT Spark engine")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = [a for a in argv if not a.startswith("-")][:1]
    for name, module in SUBCOMMANDS.items():
        # Import only the requested subcommand's module; list the rest for --help.
        if wanted and wanted[0] != name:
            subparsers.add_parser(name)
            continue
        try:
            importlib.import_module(module).register(subparsers)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            # Left out of this build (e.g. benchmarks in the frozen app): accept any arguments, then say so.
            missing = subparsers.add_parser(name, help="(not available in this build)")
            missing.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        print(f"error: `{args.command}` is not available in this build.", file=sys.stderr)
        return 2
    return run_command(func, args)


def _one_line_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> str:
    return f"warning: {shown(str(message), MAX_ERROR_CHARS)}\n"


OUT_OF_MEMORY = "error: MLoT Spark ran out of memory (the memory limit of this process included); free memory, raise the limit or choose a smaller model."


def run_command(func: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run a subcommand the way every MLoT Spark CLI does: a SparkError is one line on stderr and exit 2, Ctrl-C is
    exit 130, never a traceback for either; a warning (e.g. the cache turning itself off) is one line too."""
    warnings.formatwarning = _one_line_warning
    try:
        return int(func(args) or 0)
    except SparkError as exc:
        # A name from a file or a server may sit in the sentence: escaped, it cannot split the line or drive the terminal.
        print(f"error: {shown(str(exc), MAX_ERROR_CHARS)}", file=sys.stderr)
        return 2
    except MemoryError:  # numpy's too; torch's allocator raises RuntimeError("... can't allocate memory ...")
        print(OUT_OF_MEMORY, file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if "can't allocate memory" not in str(exc):
            raise
        print(OUT_OF_MEMORY, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
