"""`bench long-ppl`: perplexity on a long held-out document (at least 1.5x the cascade's slots) with the cascade,
with sinks + window only (StreamingLLM: the same geometry with retrieval_blocks=0), with sinks + a window as
large as the cascade's slot budget, and with plain truncation (independent segments as long as the slot budget).
Headlines `ppl_cascade`, `ppl_window`, `ppl_window_equal_slots`, `ppl_truncate`; goal ppl_cascade <=
ppl_window_equal_slots (retrieval pays for its slots). The geometry is the model's default (the window covers the
trained context) unless `--window N` forces the window, as a model folder's cascade.json would.

The document is a fixed sample of the local standard library's pydoc pages (engine.heldout.docs),
concatenated in name order and cut to `MAX_TOKENS`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.backends import open_backend
from engine.backends.base import Backend
from engine.errors import SparkError
from engine.heldout.docs import held_out_text
from engine.loading.model_files import resolve_model_path, settings_dir
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory
from engine.memory.cascade import CascadeConfig, CascadeMemory

CHUNK = 64  # small chunks: tokens early in a chunk that wraps the window see W - T + 1 window tokens, not W
MAX_TOKENS = 12288
QUICK_TOKENS = 3072


def nll(backend: Backend, memory: Memory, ids: list[int]) -> tuple[float, int]:
    """Summed next-token NLL of ids[1:] and how many tokens it covers, feeding CHUNK-token forwards."""
    total = 0.0
    for at in range(0, len(ids) - 1, CHUNK):
        piece = ids[at : at + CHUNK]
        targets = torch.tensor(ids[at + 1 : at + 1 + len(piece)])
        logits = backend.forward(torch.tensor([piece]), memory.plan(piece).as_batch())[0, : len(targets)]  # (T, V)
        memory.after_forward()
        total += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
    return total, len(ids) - 1


def open_model(args: argparse.Namespace) -> tuple[Path, Backend, Tokenizer, CascadeConfig]:
    """The long-context benches' set-up: --model (default: the default model) on --backend with --quantize, its
    tokenizer, and its cascade geometry with --window forced when given."""
    model = resolve_model_path(args.model)  # a missing path is refused by the loader in one sentence
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    backend = open_backend(model, args.backend or "cpu", getattr(args, "quantize", "none")).backend
    window = getattr(args, "window", None)
    cfg = CascadeConfig.for_model(settings_dir(model), backend.config, **({"window": window} if window else {}))
    return model, backend, Tokenizer.load(model), cfg


def run(args: argparse.Namespace) -> dict[str, object]:
    model, backend, tok, cfg = open_model(args)
    n = max(QUICK_TOKENS if getattr(args, "quick", False) else MAX_TOKENS, 3 * cfg.used_slots // 2)
    ids = tok.encode(held_out_text(min_chars=n * 6))[:n]
    if 2 * len(ids) < 3 * cfg.used_slots:
        raise SparkError(
            f"The held-out text has only {len(ids)} tokens, less than 1.5x the cascade's {cfg.used_slots} slots."
        )
    budget = cfg.used_slots
    variants = {
        "cascade": cfg,
        "window": replace(cfg, retrieval_blocks=0),
        "window_equal_slots": replace(cfg, retrieval_blocks=0, window=budget - cfg.sink_tokens),
    }
    out: dict[str, object] = {}
    for name, c in variants.items():
        backend.allocate(1, c.num_slots)
        total, count = nll(backend, CascadeMemory(backend, c), ids)
        out[f"ppl_{name}"] = math.exp(total / count)
    backend.allocate(1, budget)
    total, count = 0.0, 0
    for at in range(0, len(ids) - 1, budget):  # truncation: independent segments of the same slot budget
        seg_total, seg_count = nll(backend, FullAttentionMemory(backend), ids[at : at + budget])
        total, count = total + seg_total, count + seg_count
    out["ppl_truncate"] = math.exp(total / count)
    out.update(
        {
            "model": str(model),
            "numerics": backend.numerics,
            "tokens": len(ids),
            "window": cfg.window,
            "retrieval_blocks": cfg.retrieval_blocks,
            "slot_budget": budget,
        }
    )
    return out
