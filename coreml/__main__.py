"""`python -m coreml convert --model DIR --out PKG [--quantize ...] [--slots S]` and `python -m coreml check PKG`.

Errors the user can act on print one line on stderr and exit 2 (as `python -m engine` does); a package that
fails `check` exits 1."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from engine.cli import run_command


def _convert(args: argparse.Namespace) -> int:
    from coreml.convert import convert

    def progress(stage: str, fraction: float) -> None:
        print(f"[{fraction * 100:5.1f}%] {stage}", file=sys.stderr, flush=True)

    from engine.model_files import resolve_model_path

    model = resolve_model_path(args.model)
    out = convert(model, args.out, quantize=args.quantize, slots=args.slots, progress=progress)
    print(out)
    return 0


def _check(args: argparse.Namespace) -> int:
    from coreml.check import run_checks

    failed = None
    for line in run_checks(args.package):
        print(line, flush=True)
        if not line.ok and failed is None:
            failed = line
    if failed is not None:
        print(f"error: {args.package} is not sound: {failed.name}: {failed.detail}", file=sys.stderr)
        return 1
    print("sound")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from coreml.convert import DEFAULT_SLOTS, QUANTIZATIONS

    parser = argparse.ArgumentParser(prog="python -m coreml", description="MLoT Spark Core ML conversion and checks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("convert", help="convert a model folder to a stateful multifunction .mlpackage")
    c.add_argument("--model", default=None, help="Hugging Face model folder or .gguf (default: the default model)")
    c.add_argument("--out", required=True, help="the .mlpackage to write")
    c.add_argument("--quantize", choices=QUANTIZATIONS, default="none")
    c.add_argument("--slots", type=int, default=DEFAULT_SLOTS, help=f"slot table size (multiple of 32; default {DEFAULT_SLOTS})")
    c.set_defaults(func=_convert)
    k = sub.add_parser("check", help="validate a package: structure, provenance, ANE rules, reference run")
    k.add_argument("package")
    k.set_defaults(func=_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
