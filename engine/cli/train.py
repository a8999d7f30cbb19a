"""`python -m engine train` — train the bundled default model (see engine/train/loop.py and resources/models/README.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.errors import SparkError


class TrainArgumentError(SparkError):
    """A train option is out of range."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from engine.train.loop import TrainConfig  # defaults live in one place

    d = TrainConfig(out=Path("."))
    p = subparsers.add_parser("train", help="train the bundled demo model on the local stdlib documentation")
    p.add_argument("--out", type=Path, required=True, help="work folder: corpus, tokenizer, checkpoints, summary")
    p.add_argument("--export", type=Path, default=None, help="HF model folder written at the end (default OUT/model)")
    p.add_argument("--minutes", type=float, default=d.minutes, help="wall-clock budget; plans the schedule to fit")
    p.add_argument("--steps", type=int, default=None, help="fixed number of steps instead of planning from --minutes")
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device)
    p.add_argument("--threads", type=int, default=d.threads, help="CPU threads (cpu device)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out with its recipe")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--layers", type=int, default=d.num_layers)
    p.add_argument("--heads", type=int, default=d.num_heads)
    p.add_argument("--kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="final training context = max_position_embeddings")
    p.add_argument("--short-seq-len", type=int, default=d.short_seq_len, help="context of the first, cheaper phase")
    p.add_argument("--short-fraction", type=float, default=d.short_fraction, help="fraction of steps at --short-seq-len")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--modules", nargs="+", default=None, help="build the corpus from these stdlib modules only")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from engine.train.loop import TrainConfig, run

    if args.minutes <= 0 or (args.steps is not None and args.steps <= 0):
        raise TrainArgumentError("--minutes and --steps must be positive.")
    if not 0.0 <= args.short_fraction < 1.0:
        raise TrainArgumentError("--short-fraction must be at least 0 and below 1, so the model ends at --seq-len.")
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        raise TrainArgumentError("--hidden-size must be divisible by --heads, and --heads by --kv-heads.")
    cfg = TrainConfig(
        out=args.out,
        export=args.export,
        minutes=args.minutes,
        steps=args.steps,
        device=args.device,
        threads=args.threads,
        seed=args.seed,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
        seq_len=args.seq_len,
        short_seq_len=args.short_seq_len,
        short_fraction=args.short_fraction,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        modules=args.modules,
    )
    summary = run(cfg, resume=args.resume)
    return 3 if summary.get("stopped") else 0
