"""`bench profile`: where a generation step's time goes, from `engine.generation.profiler`, on the session's real memory.

One warm-up generation, then one profiled: a 128-token prompt (prefill) and `decode_tokens` greedy decode steps
over the cascade memory the app uses (prefix cache off, so paging is the working/episodic path). Reports the
per-step breakdown of decode and prefill steps, `sum_error` (|sum of parts − total| ÷ total, decode steps),
`slowest` (the slowest category of a decode step: attention, mlp, lm_head, embedding, native_step (a whole
step on the native CPU kernels), paging, sampling,
detokenize, backend_overhead) and writes a Chrome trace (chrome://tracing or ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from engine.backends import open_backend
from engine.bench.batch import bench_model
from engine.generation.loop import GenerationSettings, stream_generate
from engine.generation.profiler import Profiler, cuda_sync_for
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.session.engine import memory_factory_for

PROMPT_TOKENS = 128


def run(args: argparse.Namespace) -> dict[str, object]:
    if args.threads:
        torch.set_num_threads(args.threads)
    n_decode = 16 if args.quick else 64
    with tempfile.TemporaryDirectory(prefix="spark-bench-") as tmp:
        model_dir, label = bench_model(args, tmp)
        backend = open_backend(model_dir, args.backend, args.quantize).backend
        tok = Tokenizer.load(model_dir)
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(1, min(backend.config.vocab_size, 30000), (PROMPT_TOKENS,), generator=g).tolist()
        settings = GenerationSettings(
            max_tokens=n_decode, sampling=SamplingSettings(greedy=True), ignore_eos=True, prefill_chunk=PROMPT_TOKENS
        )
        new_memory = memory_factory_for(model_dir, prefix_cache=False)
        list(stream_generate(backend, new_memory(backend), tok, ids, settings))  # warm-up
        profiler = Profiler(sync=cuda_sync_for(backend))
        list(profiler.stream_generate(backend, new_memory(backend), tok, ids, settings))
    decode, prefill = profiler.breakdown("decode"), profiler.breakdown("prefill")
    trace = profiler.export_chrome_trace(Path(tempfile.gettempdir()) / "spark-profile-trace.json")
    return {
        "model": label,
        "backend": backend.name,
        "numerics": backend.numerics,
        "threads": torch.get_num_threads(),
        "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": n_decode,
        "sum_error": round(decode.sum_error, 4),
        "slowest": decode.bottlenecks(1)[0][0],
        "slowest_part": decode.bottlenecks(1, by_category=False)[0][0],
        "bottlenecks_ms_per_step": {k: round(v * 1000 / decode.steps, 3) for k, v in decode.bottlenecks(3)},
        "decode": decode.as_dict(),
        "prefill": prefill.as_dict(),
        "prefill_sum_error": round(prefill.sum_error, 4),
        "chrome_trace": str(trace),
    }
