"""`python -m coreml convert --model DIR [--out BUNDLE] [--quantize ...] [--units ...] [--slots S]` (without `--out`
into the conversion cache the Core ML backend reads, engine.backends.coreml.cache; for a SmolVLM / Idefics3 folder
its vision encoder's program too), `python -m coreml check BUNDLE` and `python -m coreml faithfulness --model DIR`.

Errors the user can act on print one line on stderr and exit 2 (as `python -m engine` does); a bundle that
fails `check` exits 1. Converting prints its progress on stderr; Ctrl-C cancels it and leaves nothing behind."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from engine.cli import run_command


def _convert(args: argparse.Namespace) -> int:
    from coreml.convert import cached_bundle, convert
    from coreml.vision import convert_encoder
    from engine.backends.coreml.vision_runtime import cache_encoder

    def progress(stage: str, fraction: float) -> None:
        print(f"[{fraction * 100:5.1f}%] {stage}", file=sys.stderr, flush=True)

    from engine.loading.model_files import resolve_model_path

    model = resolve_model_path(args.model)
    try:
        if args.out is None:
            out = cached_bundle(model, slots=args.slots, quantize=args.quantize, units=args.units, progress=progress)
            encoder = cache_encoder(model, units=args.units, convert=convert_encoder)  # a model that sees images
            if encoder is not None:
                print(f"vision encoder: {encoder}", file=sys.stderr, flush=True)
        else:
            out = convert(
                model, args.out, quantize=args.quantize, units=args.units, slots=args.slots, progress=progress
            )
    except KeyboardInterrupt:
        print("error: the Core ML conversion was cancelled; nothing was written.", file=sys.stderr)
        return 130
    print(out)
    return 0


def _check(args: argparse.Namespace) -> int:
    from coreml.check import run_checks

    failed = None
    for line in run_checks(args.bundle):
        print(line, flush=True)
        if not line.ok and failed is None:
            failed = line
    if failed is not None:
        print(f"error: {args.bundle} is not sound: {failed.name}: {failed.detail}", file=sys.stderr)
        return 1
    print("sound")
    return 0


def _faithfulness(args: argparse.Namespace) -> int:
    import json

    from coreml.faithfulness import measure
    from engine.heldout.docs import held_out_text
    from engine.loading.model_files import resolve_model_path

    model = resolve_model_path(args.model)
    for r in measure(model, tuple(args.quantize), held_out_text(args.tokens * 8), max_tokens=args.tokens):
        print(json.dumps({"quantize": r.quantize, "mean_kld": r.mean_kld, "same_top": r.same_top, "tokens": r.tokens}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.backends.coreml.programs import COMPUTE_UNITS, DEFAULT_UNITS, QUANTIZATIONS

    parser = argparse.ArgumentParser(prog="python -m coreml", description="MLoT Spark Core ML conversion and checks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser(
        "convert", help="convert a model folder to a Core ML bundle (layer chunks + head, multifunction)"
    )
    c.add_argument("--model", default=None, help="Hugging Face model folder or .gguf (default: the default model)")
    c.add_argument(
        "--out",
        default=None,
        help="the bundle folder to write (default: the conversion cache the Core ML backend reads)",
    )
    c.add_argument(
        "--quantize",
        choices=("auto", *QUANTIZATIONS),
        default="auto",
        help="weight compression (auto: the most faithful Neural Engine choice)",
    )
    c.add_argument("--units", choices=COMPUTE_UNITS, default=DEFAULT_UNITS, help="compute units the bundle is made for")
    c.add_argument(
        "--slots",
        type=int,
        default=None,
        help="slot table size (multiple of 32; default: the model's cascade geometry)",
    )
    c.set_defaults(func=_convert)
    k = sub.add_parser("check", help="validate a bundle: structure, size, ANE lint, reference run")
    k.add_argument("bundle")
    k.set_defaults(func=_check)
    f = sub.add_parser(
        "faithfulness", help="mean KL divergence and same-top-token rate of each compression against fp32"
    )
    f.add_argument("--model", default=None)
    f.add_argument("--quantize", nargs="+", default=[q for q in QUANTIZATIONS if q != "int4"])
    f.add_argument("--tokens", type=int, default=512)
    f.set_defaults(func=_faithfulness)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
