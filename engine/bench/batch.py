"""`bench batch`: throughput of 32 requests batched vs the same 32 run one after another, same run, same model.

Every request gets a prompt of 16-64 token ids and generates exactly 128 tokens (a short chat reply; 8 with
--quick) greedily, EOS ignored so both sides do the same work, with full-attention memory (this measures batching,
not the cascade). Prefill is compute-bound either way, so the shorter the replies the lower the speedup: batching
wins on decode, where one row per step is memory-bound and 32 rows per step are not. Measured:
  - sequential: each request alone through `stream_generate` on a one-row slot table;
  - batched: `generate_batch` with all 32 in one batch (`speedup` = batched ÷ sequential tokens/s);
  - continuous: the same 32 submitted at once to the `Scheduler` (32 rows), which prefills in chunks and decodes.
Best of two interleaved rounds per path (one with --quick).
`same_tokens` is the share of requests whose batched tokens equal their sequential ones.
Default model: the default model (SmolLM2-135M-Instruct); --model for any other.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.backends import open_backend
from engine.backends.base import Backend
from engine.generation.batch import generate_batch
from engine.generation.loop import GenerationSettings, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.generation.scheduler import Request, Scheduler, SchedulerConfig
from engine.loading.model_files import display_name, resolve_model_path
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory

REQUESTS = 32
REPLY_TOKENS = 128


def bench_model(args: argparse.Namespace, tmp: str) -> tuple[Path, str]:
    """The --model path, else the default model, and the name the report gives it."""
    model = resolve_model_path(args.model)
    return model, display_name(model)


def prompts(vocab: int, n: int, seed: int = 99) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (n,), generator=g).tolist()
    return [torch.randint(1, min(vocab, 30000), (k,), generator=g).tolist() for k in lengths]


def sequential(backend: Backend, tok: Tokenizer, ps: list[list[int]], settings: GenerationSettings) -> list[list[int]]:
    backend.allocate(1, max(len(p) for p in ps) + settings.max_tokens)
    return [
        [
            ev.token
            for ev in stream_generate(backend, FullAttentionMemory(backend), tok, p, settings)
            if ev.token is not None
        ]
        for p in ps
    ]


def continuous(backend: Backend, tok: Tokenizer, ps: list[list[int]], settings: GenerationSettings) -> list[list[int]]:
    config = SchedulerConfig(
        max_batch=len(ps), num_slots=max(len(p) for p in ps) + settings.max_tokens, max_queue=len(ps)
    )
    with Scheduler(backend, tok, config) as sched:
        futures = [sched.submit(Request(p, settings)) for p in ps]
        return [f.result().tokens for f in futures]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    n_tokens = getattr(args, "reply_tokens", 8 if args.quick else REPLY_TOKENS)
    n_requests = getattr(args, "requests", REQUESTS)
    with tempfile.TemporaryDirectory(prefix="spark-bench-") as tmp:
        model_dir, label = bench_model(args, tmp)
        backend = open_backend(model_dir, args.backend).backend
        tok = Tokenizer.load(model_dir)
        ps = prompts(backend.config.vocab_size, n_requests)
        settings = GenerationSettings(max_tokens=n_tokens, sampling=SamplingSettings(greedy=True), ignore_eos=True)
        warm = GenerationSettings(max_tokens=2, sampling=SamplingSettings(greedy=True), ignore_eos=True)
        # Warm-up at the measured shapes (allocator, thread pools, kernel selection), then interleaved rounds; the
        # best round per path is kept, so a burst of background load does not decide the ratio.
        sequential(backend.fork(), tok, ps[:2], warm)
        generate_batch(backend.fork(), tok, ps, warm, max_batch=n_requests)
        continuous(backend.fork(), tok, ps, warm)
        timings: dict[str, float] = {}
        outputs: dict[str, list[list[int]]] = {}
        paths: dict[str, Callable[[], list[list[int]]]] = {
            "sequential": lambda: sequential(backend.fork(), tok, ps, settings),
            "batched": lambda: [
                c.tokens for c in generate_batch(backend.fork(), tok, ps, settings, max_batch=n_requests)
            ],
            "continuous": lambda: continuous(backend.fork(), tok, ps, settings),
        }
        for _ in range(1 if args.quick else 2):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                outputs[name] = fn()
                timings[name] = min(timings.get(name, float("inf")), time.perf_counter() - t0)
    generated = n_requests * n_tokens
    tps = {name: generated / t for name, t in timings.items()}
    return {
        "model": label,
        "backend": backend.name,
        "threads": torch.get_num_threads(),
        "requests": n_requests,
        "prompt_tokens": sum(len(p) for p in ps),
        "tokens_per_request": n_tokens,
        "sequential_tps": round(tps["sequential"], 1),
        "batched_tps": round(tps["batched"], 1),
        "continuous_tps": round(tps["continuous"], 1),
        "speedup": round(tps["batched"] / tps["sequential"], 2),
        "speedup_continuous": round(tps["continuous"] / tps["sequential"], 2),
        "same_tokens": sum(a == b for a, b in zip(outputs["batched"], outputs["sequential"], strict=True)) / n_requests,
        "same_tokens_continuous": sum(a == b for a, b in zip(outputs["continuous"], outputs["sequential"], strict=True))
        / n_requests,
    }
