"""`python -m engine serve [--model M] [--host 127.0.0.1] [--port 8080] [--api-key K] [--speculative MODE]
[--draft-model M]`: the OpenAI-compatible server (engine.openai) on the loaded model, continuous batching through the scheduler."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from engine.cli.generate import add_model_args, open_engine
from engine.errors import SparkError
from engine.generation.speculative import Speculation
from engine.openai.server import LOOPBACK, LocalServer, bind
from engine.openai.service import ModelService, ServeConfig, served_name


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_args(p)
    p.add_argument("--host", default=LOOPBACK, help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require this key as 'Authorization: Bearer KEY' (default: $MLOT_SPARK_API_KEY, else none)",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help='the name clients send as "model" (default: the model\'s folder or file name)',
    )
    p.add_argument("--max-batch", type=int, default=8, help="requests generating at once")
    p.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs in requests (default: only inline data: URLs are read)",
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond those (more get 429)")
    p.add_argument("--max-prompt-tokens", type=int, default=16384, help="longer prompts get 413")
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        help="allow browser requests from this origin (CORS; off by default)",
    )
    p.add_argument(
        "--speculative",
        default=Speculation.OFF.value,
        choices=[m.value for m in Speculation],
        help='speculative decoding for requests that do not send "speculative": off (default), auto (prompt lookup '
        "where it pays), lookup, draft (needs --draft-model)",
    )
    p.add_argument(
        "--draft-model",
        type=Path,
        default=None,
        help='a smaller model of the same vocabulary, for requests speculating with "draft"',
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise SparkError(f"--port must be between 0 and 65535, not {args.port}.")
    for flag, value in (
        ("--max-batch", args.max_batch),
        ("--max-queue", args.max_queue),
        ("--max-prompt-tokens", args.max_prompt_tokens),
    ):
        if value < 1:
            raise SparkError(f"{flag} must be at least 1, not {value}.")
    if args.speculative == Speculation.DRAFT and args.draft_model is None:
        raise SparkError("--speculative draft needs --draft-model M (a smaller model of the same vocabulary).")
    key = args.api_key if args.api_key is not None else os.environ.get("MLOT_SPARK_API_KEY") or None
    bind(args.host, args.port).close()  # a taken port fails now, not after the model has loaded
    engine = open_engine(args)
    config = ServeConfig(
        model_id=args.model_name or served_name(engine.model_dir),
        api_key=key,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_prompt_tokens=args.max_prompt_tokens,
        allow_origins=tuple(args.allow_origin),
        speculative=Speculation(args.speculative),
        allow_image_urls=args.allow_image_urls,
    )
    server = LocalServer(
        ModelService(
            engine.locked_fork(), engine.tokenizer, engine.memory_factory, config, engine.draft, vision=engine.vision
        ),
        args.host,
        args.port,
    )
    if args.host not in (LOOPBACK, "localhost", "::1") and key is None:
        print(
            "warning: listening beyond this machine without --api-key; anyone who can reach it may use it.",
            file=sys.stderr,
        )
    if server.service.rows < config.max_batch:
        print(
            f"note: {server.service.rows} request(s) generate at once, not {config.max_batch}: that is what this process's memory holds.",
            file=sys.stderr,
        )
    print(f"serving {config.model_id} at {server.url} (backend: {engine.choice.explain()})", file=sys.stderr)
    server.serve_forever()
    return 0
