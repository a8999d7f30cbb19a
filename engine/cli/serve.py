"""`python -m engine serve [--model M] [--host 127.0.0.1] [--port 8080] [--api-key K] [--speculative MODE]
[--draft-model M] [--add-model M ...] [--max-models N] [--keep-alive SECONDS]`: the OpenAI-compatible server
(engine.openai), continuous batching through the scheduler, over every model it can serve by name: `--model` (loaded
at start), each `--add-model`, and every model of the library, loaded when a request names it
(engine.openai.pool)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from engine.cli.generate import add_model_args, open_engine
from engine.documents.extract import MAX_FILE_BYTES
from engine.errors import SparkError
from engine.generation.speculative import Speculation
from engine.library.store import ModelStore
from engine.loading.model_files import check_model_path, resolve_model_path
from engine.model.kv_types import KVType
from engine.openai.files import FileLimits
from engine.openai.models import LoadSettings, loader_for, model_size, servable_models
from engine.openai.pool import ModelPool, Servable
from engine.openai.server import LOOPBACK, LocalServer, bind
from engine.openai.service import ModelService, ServeConfig, served_name
from engine.paths import models_dir


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
    limits = FileLimits()
    p.add_argument(
        "--max-file-bytes",
        type=int,
        default=limits.max_file_bytes,
        help=f"largest upload to /v1/files (default and most: {MAX_FILE_BYTES:,}); larger ones get 413",
    )
    p.add_argument("--max-files", type=int, default=limits.max_files, help="uploaded files held at once (more get 413)")
    p.add_argument(
        "--max-files-bytes",
        type=int,
        default=limits.max_total_bytes,
        help="bytes of uploaded files held at once (an upload past it gets 413; delete files to make room)",
    )
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
    p.add_argument(
        "--add-model",
        type=Path,
        action="append",
        default=[],
        help="another model to serve by its name (folder, .gguf or library name; repeatable); the library's "
        "downloaded models are served too",
    )
    p.add_argument(
        "--max-models", type=int, default=1, help="models resident at once (default 1; fewer when memory says so)"
    )
    p.add_argument(
        "--keep-alive",
        type=float,
        default=-1.0,
        help="unload a model after this many idle seconds (default -1: keep it; Ollama's keep_alive per request)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise SparkError(f"--port must be between 0 and 65535, not {args.port}.")
    for flag, value in (
        ("--max-batch", args.max_batch),
        ("--max-queue", args.max_queue),
        ("--max-prompt-tokens", args.max_prompt_tokens),
        ("--max-file-bytes", args.max_file_bytes),
        ("--max-files", args.max_files),
        ("--max-files-bytes", args.max_files_bytes),
    ):
        if value < 1:
            raise SparkError(f"{flag} must be at least 1, not {value}.")
    if args.max_file_bytes > MAX_FILE_BYTES:
        raise SparkError(f"--max-file-bytes may be at most {MAX_FILE_BYTES:,}, the most a document may weigh.")
    if args.speculative == Speculation.DRAFT and args.draft_model is None:
        raise SparkError("--speculative draft needs --draft-model M (a smaller model of the same vocabulary).")
    if args.max_models < 1:
        raise SparkError(f"--max-models must be at least 1, not {args.max_models}.")
    key = args.api_key if args.api_key is not None else os.environ.get("MLOT_SPARK_API_KEY") or None
    extra = [resolve_model_path(m) for m in args.add_model]
    for path in extra:
        check_model_path(path)  # a wrong path fails now, not when a request names it
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
        files=FileLimits(args.max_file_bytes, args.max_files, args.max_files_bytes),
    )
    default = Servable(config.model_id, engine.model_dir, model_size(engine.model_dir))
    servable = servable_models(default, extra, ModelStore(models_dir()).models())
    keep_alive = None if args.keep_alive < 0 else args.keep_alive
    projectors = ((engine.model_dir, engine.mmproj),) if engine.mmproj is not None else ()
    loader = loader_for(dataclasses.replace(load_settings(args), projectors=projectors))
    pool = ModelPool(servable, config, loader, max_models=args.max_models, keep_alive_s=keep_alive)
    first = ModelService(
        engine.locked_fork(),
        engine.tokenizer,
        engine.memory_factory,
        config,
        engine.draft,
        pool.metrics,
        vision=engine.vision,
    )
    pool.adopt(config.model_id, first)
    server = LocalServer(pool, args.host, args.port)
    if args.host not in (LOOPBACK, "localhost", "::1") and key is None:
        print(
            "warning: listening beyond this machine without --api-key; anyone who can reach it may use it.",
            file=sys.stderr,
        )
    if first.rows < config.max_batch:
        print(
            f"note: {first.rows} request(s) generate at once, not {config.max_batch}: that is what this process's memory holds.",
            file=sys.stderr,
        )
    others = f" and {len(servable) - 1} more by name" if len(servable) > 1 else ""
    print(f"serving {config.model_id}{others} at {server.url} (backend: {engine.choice.explain()})", file=sys.stderr)
    # From here the pool alone holds the first model: unloading it (--max-models, --keep-alive) frees its weights.
    del engine, first
    server.serve_forever()
    return 0


def load_settings(args: argparse.Namespace) -> LoadSettings:
    """The model flags as the loader of every further model takes them (the first was loaded by them too)."""
    return LoadSettings(
        backend=args.backend,
        quantize=args.quantize,
        kv_type=KVType(args.kv_type),
        cache_dir=args.cache_dir,
        prefix_cache=not args.no_prefix_cache,
    )
