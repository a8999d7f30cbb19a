"""`bench cascade`: decode ms/token and peak RSS at 256 tokens, where the window first fills, 16k and 32k tokens of
conversation, cascade vs full attention (where it fits the trained context), on the path users run: the default
geometry (the window covers the trained context), the default weights (`--quantize auto`: a GGUF as stored, else
q8_0, on the native kernels on the CPU), re-routing and paging included. Headline `cost_ratio_32k` = cascade ms/token at 32k / at the
length where the window first fills (goal <= 1.1, with RSS flat).

Peak RSS: each (memory, length) point runs in its own process so its ru_maxrss is its own. Timing: all points
live in one process and take turns (DECODE_ROUNDS rounds of DECODE_STEPS steps), medians. The cascade is fed the
whole conversation for real (chunked prefill through the cascade: evictions, episodic blocks, routing). Full
attention gets its N slots filled by `load_state` with random KV instead of an O(N^2) prefill: decode cost does
not depend on the KV's values, and the contrast is what it is for.

Default model: a random checkpoint with a small Llama shape and SmolLM2's 8k trained context, written to a temp
dir; `--model` measures another. The episodic budget is 16 MiB here so it fills early and the
RSS curve shows the bound (the product default is larger).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.backends import open_backend
from engine.backends.base import Backend
from engine.bench.checkpoints import write_random_checkpoint
from engine.loading.model_files import read_config, settings_dir
from engine.memory.base import FullAttentionMemory, Memory
from engine.memory.cascade import CascadeConfig, CascadeMemory

LENGTHS = (256, 16384, 32768)  # and the length where the window first fills (see lengths_for)
DECODE_STEPS = 16  # per round; rounds interleave the points
DECODE_ROUNDS = 8
WARMUP = 8
CHUNK = 256
EPISODIC_BUDGET = 16 * 1024**2
BENCH_SHAPE: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def build(
    model: Path, mode: str, n: int, backend_name: str, quantize: str
) -> tuple[Backend, Memory, torch.Tensor] | None:
    """An n-token conversation in `mode` ("cascade" | "full") on its own backend; None if full attention cannot
    hold it. Returns the backend, the memory and the last logits (1, 1, V)."""
    backend = open_backend(model, backend_name, quantize).backend
    vocab = backend.config.vocab_size
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    if mode == "cascade":
        cfg = CascadeConfig.for_model(settings_dir(model), backend.config, episodic_budget_bytes=EPISODIC_BUDGET)
        cascade = CascadeMemory(backend, cfg)
        for at in range(0, n, CHUNK):
            piece = ids[at : at + CHUNK]
            logits = backend.forward(torch.tensor([piece]), cascade.plan(piece).as_batch(), last_only=True)
            cascade.after_forward()
        return backend, cascade, logits
    if n + DECODE_ROUNDS * DECODE_STEPS + WARMUP > backend.config.max_position_embeddings:
        return None
    backend.allocate(1, n + DECODE_ROUNDS * DECODE_STEPS + WARMUP)
    full = FullAttentionMemory(backend)
    c = backend.config
    shape = (c.num_hidden_layers, c.num_key_value_heads, n, c.head_dim)
    full.load_state({"kind": "full", "tokens": ids}, {"k": torch.randn(shape).half(), "v": torch.randn(shape).half()})
    return backend, full, torch.zeros(1, 1, vocab)


def decode(backend: Backend, memory: Memory, logits: torch.Tensor, steps: int) -> tuple[list[float], torch.Tensor]:
    """`steps` greedy decode steps; returns each step's seconds and the last logits."""
    times = []
    for _ in range(steps):
        tok = int(logits[0, -1].argmax())
        t0 = time.perf_counter()
        plan = memory.plan([tok])
        logits = backend.forward(torch.tensor([[tok]]), plan.as_batch(), last_only=True)
        memory.after_forward()
        times.append(time.perf_counter() - t0)
    return times, logits


def peak_rss_point(model: Path, mode: str, n: int, backend_name: str, quantize: str) -> dict[str, object]:
    """Run in a fresh process: build the conversation, decode a little, report this process's peak RSS."""
    built = build(model, mode, n, backend_name, quantize)
    if built is None:
        return {"peak_rss_bytes": None}
    decode(*built, steps=WARMUP + DECODE_STEPS)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_bytes": peak if sys.platform == "darwin" else peak * 1024}  # bytes on macOS, KiB on Linux


def fill_length(model: Path) -> tuple[int, CascadeConfig]:
    """Tokens at which the default geometry's window first fills (sinks + window), and that geometry."""

    cfg = CascadeConfig.for_model(settings_dir(model), read_config(model))
    return cfg.sink_tokens + cfg.window, cfg


def run(args: argparse.Namespace) -> dict[str, object]:
    threads = getattr(args, "threads", None) or 1
    torch.set_num_threads(threads)
    backend_name = args.backend or "cpu"
    quantize = getattr(args, "quantize", None) or "auto"
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_random_checkpoint(Path(tmp) / "cascade-bench", BENCH_SHAPE)
        fill, geometry = fill_length(model)
        lengths = sorted({LENGTHS[0], fill, *(LENGTHS[1:] if not getattr(args, "quick", False) else ())})
        rss: dict[str, dict[int, float | None]] = {"cascade": {}, "full": {}}
        for n in lengths:
            for mode in ("cascade", "full"):
                cmd = [
                    sys.executable,
                    "-m",
                    "engine.bench.cascade",
                    str(model),
                    mode,
                    str(n),
                    backend_name,
                    str(threads),
                    quantize,
                ]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    return {"error": f"{mode} at {n} tokens failed: {proc.stderr.strip().splitlines()[-1:]}"}
                peak = json.loads(proc.stdout)["peak_rss_bytes"]
                rss[mode][n] = None if peak is None else round(peak / 2**20, 1)
        # Timing: every point lives in this one process and they take turns, so load from other processes on the
        # machine hits all points alike instead of skewing whichever ran during a busy minute.
        points = {
            (mode, n): build(model, mode, n, backend_name, quantize) for mode in ("cascade", "full") for n in lengths
        }
        live = {key: p for key, p in points.items() if p is not None}
        last = {key: logits for key, (_, _, logits) in live.items()}  # each point's latest logits
        times: dict[tuple[str, int], list[float]] = {key: [] for key in live}
        for key, (b, m, _) in live.items():
            last[key] = decode(b, m, last[key], WARMUP)[1]
        for _ in range(DECODE_ROUNDS):
            for key, (b, m, _) in live.items():
                step_times, last[key] = decode(b, m, last[key], DECODE_STEPS)
                times[key] += step_times
        stats = live[("cascade", lengths[-1])][1].stats().to_dict()  # type: ignore[attr-defined]  # the "cascade" point's memory is a CascadeMemory; build() returns the Memory protocol
        numerics = live[("cascade", lengths[-1])][0].numerics
    ms = {key: 1000 * statistics.median(t) for key, t in times.items()}
    first, last = lengths[0], lengths[-1]
    return {
        "cost_ratio_32k": ms[("cascade", last)] / ms[("cascade", fill)] if last >= 32768 else None,
        "cost_ratio_longest": ms[("cascade", last)] / ms[("cascade", fill)],
        "cost_ratio_vs_256": ms[("cascade", last)] / ms[("cascade", first)],
        "window_fills_at": fill,
        "geometry": {
            "sink_tokens": geometry.sink_tokens,
            "window": geometry.window,
            "block_size": geometry.block_size,
            "retrieval_blocks": geometry.retrieval_blocks,
        },
        "numerics": numerics,
        "cascade_ms_per_token": {n: round(ms[("cascade", n)], 3) for n in lengths},
        "full_ms_per_token": {n: round(ms[("full", n)], 3) if ("full", n) in ms else None for n in lengths},
        "cascade_peak_rss_mib": rss["cascade"],
        "full_peak_rss_mib": rss["full"],
        "cascade_stats_at_max": stats,
        "threads": threads,
        "decode_steps_per_point": DECODE_ROUNDS * DECODE_STEPS,
    }


if __name__ == "__main__":  # one measurement point, in its own process (see module doc)
    model_arg, mode_arg, n_arg, backend_arg, threads_arg, quantize_arg = sys.argv[1:7]
    torch.set_num_threads(int(threads_arg))
    print(json.dumps(peak_rss_point(Path(model_arg), mode_arg, int(n_arg), backend_arg, quantize_arg)))
