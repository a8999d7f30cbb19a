"""`make app` step: convert the default model at its Core ML geometry, compile it, and stage it for the bundle.

    python packaging/build_coreml.py [--model DIR] [--out build/coreml]

The geometry is the model's cascade fitted to engine.backends.coreml.programs.ANE_MAX_SLOTS (coreml.convert.default_slots), which
is what the engine lays out over a CoreMLBackend (its max_slots), so both name the same slot count.
Writes `<out>/<cache key>/` (coreml.convert.cached_bundle: the key is the one CoreMLBackend looks up, so the app
finds it under resources/coreml/ and a Mac user never waits for a conversion), then on macOS compiles every
program to `.mlmodelc` beside its package (engine.backends.coreml.runtime.compile_program) and checks the bundle
(`python -m coreml check`). Off macOS it converts and checks but cannot compile: it says so and exits 1, so a
bundle without compiled programs is never shipped. spark.spec picks `<out>` up as resources/coreml.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "build" / "coreml"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from coreml.check import run_checks
    from coreml.convert import cached_bundle
    from engine.backends.coreml.bundle import Bundle
    from engine.cli import run_command

    parser = argparse.ArgumentParser(prog="packaging/build_coreml.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: the default model)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)

    def build(args: argparse.Namespace) -> int:
        from engine.loading.model_files import resolve_model_path

        def progress(stage: str, fraction: float) -> None:
            print(f"[{fraction * 100:5.1f}%] {stage}", file=sys.stderr, flush=True)

        path = cached_bundle(resolve_model_path(args.model), cache_dir=args.out, progress=progress)
        failed = [line for line in run_checks(path, smoke=False) if not line.ok]
        if failed:
            print(f"error: the converted default model is not sound: {failed[0]}", file=sys.stderr)
            return 1
        if platform.system() != "Darwin":
            print(
                f"error: {path} is converted but Core ML compiles programs only on macOS; run `make app` on a Mac.",
                file=sys.stderr,
            )
            return 1
        from engine.backends.coreml.runtime import compile_program

        bundle = Bundle.open(path)
        for name in bundle.program_names:
            print(f"compiled {compile_program(bundle, name)}", file=sys.stderr)
        print(path)
        return 0

    return run_command(build, args)


if __name__ == "__main__":
    sys.exit(main())
