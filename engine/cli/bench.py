"""`python -m engine bench SUITE [--model DIR] [--json]` — benchmarks that report ratios against a peer measured
in the same run (llama.cpp, transformers, full attention, the cold path). Never wall-clock thresholds in tests."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from engine.backends import QUANTIZE_CHOICES
from engine.cli.checks import check_threads
from engine.errors import SparkError

# suite name -> module exposing `run(args) -> dict[str, object]` (headline keys: docs/DESIGN.md, "Command-line contract")
SUITES: dict[str, str] = {
    "decode": "engine.bench.decode",
    "cascade": "engine.bench.cascade",
    "prefix-cache": "engine.bench.prefix_cache",
    "long-ppl": "engine.bench.long_ppl",
    "passkey": "engine.bench.passkey",
    "batch": "engine.bench.batch",
    "profile": "engine.bench.profile",
    "quant": "engine.bench.quant",
    "serve": "engine.bench.serve",
    "answers": "engine.bench.answers",
    "speculative": "engine.bench.speculative",
    "structured": "engine.bench.structured",
    "long-context": "engine.bench.long_context",
    "memory": "engine.bench.memory",
    "documents": "engine.bench.documents",
    "reopen": "engine.bench.reopen",
    "vision": "engine.bench.vision",
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark suite")
    p.add_argument("suite", choices=list(SUITES))
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model folder or .gguf (default: the default model, or the suite's own)",
    )
    p.add_argument("--backend", default="cpu", choices=["auto", "coreml", "mlx", "mps", "cuda", "cpu"])
    p.add_argument("--threads", type=int, default=None, help="CPU threads for us and every peer (default: all cores)")
    p.add_argument(
        "--quantize",
        default="auto",
        choices=QUANTIZE_CHOICES,
        help="our weight storage in `decode`, `profile`, `long-ppl`, `passkey` (auto: a GGUF as stored, else q8_0 on the cpu backend; int8: Core ML)",
    )
    p.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="`quant`, `decode`: a GGUF of --model's weights, run as stored by both engines",
    )
    p.add_argument(
        "--peer-gguf", type=Path, default=None, help="`serve`: the GGUF of the same weights for llama.cpp's server"
    )
    p.add_argument(
        "--peer-python",
        default=None,
        help="`vision`: an interpreter with llama-cpp-python built, to run llama.cpp's mtmd as the peer",
    )
    p.add_argument(
        "--second-model",
        type=Path,
        default=None,
        help="`serve`: the second model served by name, for switch_ms (default: --model's weights under another name)",
    )
    p.add_argument(
        "--kv-type",
        default="f16",
        choices=["f16", "q8_0"],
        help="`quant`: measure q8_0 keys and values against fp16 ones (ours and llama.cpp's) instead of weight types",
    )
    p.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke runs)")
    p.add_argument(
        "--window", type=int, default=None, help="`passkey`, `long-ppl`: force the cascade's window (tokens)"
    )
    p.add_argument("--depths", default=None, help="`passkey`: comma-separated key depths (default 0.1,0.3,0.5,0.7,0.9)")
    p.add_argument(
        "--max-length", type=int, default=None, help="`passkey`: the longest prompt (default 4x the trained context)"
    )
    p.add_argument(
        "--sizes", default=None, help="`reopen`: conversation sizes in tokens, comma-separated (default 4000,32000)"
    )
    p.add_argument(
        "--recompute-sizes", default=None, help="`reopen`: the sizes whose replay is measured (default: every size)"
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="`documents`: the corpus's size in tokens (default 32000; --quick 6000)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="`documents`: keep the capsules here and reuse them on later runs (default: a fresh temporary folder,"
        " so the first question reads every document)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_threads(args.threads)
    try:
        module = importlib.import_module(SUITES[args.suite])
    except ModuleNotFoundError as exc:
        if exc.name != SUITES[args.suite]:
            raise
        raise SparkError(f"The {args.suite} benchmark is not available in this build.") from None
    result = module.run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value}")
    return 0 if not result.get("error") else 1
