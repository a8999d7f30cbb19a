"""`bench passkey`: a five-digit key hidden in filler text at some depth, asked for at the end (the passkey test of
Landmark Attention and InfLLM). Lengths from 1k tokens to 4x the model's trained context, depths 10-90 %; the
cascade against full attention wherever the prompt and the answer fit the trained context. Headline
`accuracy_cascade` and `accuracy_full` per length (fraction of depths whose greedy answer holds the key).

The prompt is raw text (no chat template), the same for both memories; the answer is up to ANSWER_TOKENS greedy
tokens. `--window N` forces the cascade's window (as a model folder's cascade.json would); without it the cascade
runs at the model's default geometry. No prefix cache: every trial computes its prompt.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

from engine.backends.base import Backend
from engine.bench.long_ppl import open_model
from engine.generation.loop import decode_step, prefill
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory
from engine.memory.cascade import CascadeMemory

INTRO = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information there.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
QUICK_DEPTHS = (0.1, 0.5, 0.9)
CHUNK = 256


@dataclass(frozen=True)
class Trial:
    length: int  # target prompt tokens
    depth: float
    key: str
    ids: list[int]


def make_trial(tok: Tokenizer, length: int, depth: float, seed: int) -> Trial:
    """A prompt of about `length` tokens (never more) with the key after `depth` of the filler."""
    key = f"{random.Random(seed).randrange(10000, 100000)}"
    fixed = len(tok.encode(INTRO + NEEDLE.format(key=key) + QUESTION))
    per = len(tok.encode(FILLER * 8)) / 8
    n = max(1, int((length - fixed) / per))
    while True:
        before = round(n * depth)
        text = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (n - before) + QUESTION
        ids = tok.encode(text)
        if len(ids) <= length or n == 1:
            return Trial(length, depth, key, ids)
        n -= 1


def answer(backend: Backend, memory: Memory, tok: Tokenizer, ids: list[int]) -> str:
    """Greedy reply of up to ANSWER_TOKENS tokens (stops at a newline)."""
    logits = prefill(backend, memory, ids, CHUNK)
    assert logits is not None  # None only when a should_stop ends the prefill early; there is none here
    out: list[int] = []
    for _ in range(ANSWER_TOKENS):
        token = int(logits.argmax())
        out.append(token)
        if "\n" in tok.decode(out) or token in tok.eos_ids:
            break
        logits = decode_step(backend, memory, token)
    return tok.decode(out)


def lengths_for(trained: int, quick: bool, max_length: int | None) -> list[int]:
    """1k, 2k, 4k, ... up to 4x the trained context (the trained context itself included)."""
    top = min(4 * trained, max_length or 4 * trained, 4096 if quick else 4 * trained)
    out, n = [], 1024
    while n <= top:
        out.append(n)
        n *= 2
    if trained <= top and trained not in out:
        out.append(trained)
    return sorted(out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, backend, tok, cfg = open_model(args)
    trained = backend.config.max_position_embeddings
    depths: tuple[float, ...] = QUICK_DEPTHS if getattr(args, "quick", False) else DEPTHS
    if getattr(args, "depths", None):
        depths = tuple(float(d) for d in args.depths.split(","))
    lengths = lengths_for(trained, getattr(args, "quick", False), getattr(args, "max_length", None))
    per_length: dict[int, dict[str, Any]] = {}
    t0 = time.perf_counter()
    for length in lengths:
        row: dict[str, Any] = {"cascade": [], "full": []}
        for i, depth in enumerate(depths):
            # The peer's prompt and answer must fit the trained context, so the length there is what fits.
            trial = make_trial(
                tok, trained - ANSWER_TOKENS if length == trained else length, depth, seed=length * 100 + i
            )
            memory = CascadeMemory(backend, cfg)
            got = answer(backend, memory, tok, trial.ids)
            row["cascade"].append(
                {"depth": depth, "tokens": len(trial.ids), "key": trial.key, "answer": got, "ok": trial.key in got}
            )
            if len(trial.ids) + ANSWER_TOKENS <= trained:
                backend.allocate(1, len(trial.ids) + ANSWER_TOKENS)
                got = answer(backend, FullAttentionMemory(backend), tok, trial.ids)
                row["full"].append(
                    {"depth": depth, "tokens": len(trial.ids), "key": trial.key, "answer": got, "ok": trial.key in got}
                )
        per_length[length] = row
    acc = {
        name: {n: (sum(t["ok"] for t in r[name]) / len(r[name]) if r[name] else None) for n, r in per_length.items()}
        for name in ("cascade", "full")
    }
    return {
        "accuracy_cascade": acc["cascade"],
        "accuracy_full": acc["full"],
        "model": str(model),
        "numerics": backend.numerics,
        "trained_context": trained,
        "geometry": {
            "sink_tokens": cfg.sink_tokens,
            "window": cfg.window,
            "block_size": cfg.block_size,
            "retrieval_blocks": cfg.retrieval_blocks,
            "routing": cfg.routing,
        },
        "depths": list(depths),
        "seconds": round(time.perf_counter() - t0, 1),
        "trials": per_length,
    }
