"""`bench long-context`: long prompts (~2k, ~6k, ~8k tokens) on our engine and on llama.cpp, same GGUF as stored.

For each prompt length: time to first token (reading the whole prompt), decode tokens/s after it, and the peak
resident set (RSS) of the process, each engine in a fresh process of its own per run (so the peak is that run's,
loading included). Ours runs `generate`'s set-up (hardware policy, the memory cascade, the disk prefix cache in an
empty scratch dir so nothing is reused); llama.cpp runs through llama-cpp-python (engine.bench.llamacpp_peer) with
a context just large enough. Runs are interleaved (ours, llama.cpp, per length, repeated) and medians reported;
the ratios: decode ours/theirs, time to first token theirs/ours (above 1: we answer sooner), peak RSS
ours/theirs (below 1: we hold less).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine.bench.decode import prompt_ids
from engine.bench.llamacpp_peer import LlamaCppPeer, PeerError, peer_environment
from engine.bench.memory import peak_rss_bytes
from engine.errors import SparkError
from engine.loading.model_files import display_name, gguf_model, is_gguf_model, resolve_model_path
from engine.process import user_omp_wait_policy

LENGTHS = (2048, 6144, 8000)  # ~2k, ~6k, ~8k: the last leaves room for the reply inside an 8k trained context
DECODE_TOKENS = 64
MB = 1024 * 1024


def _ours_child(model: str, tokens: int, n_decode: int, vocab: int, backend: str = "cpu") -> dict[str, Any]:
    from engine.generation.loop import GenerationSettings
    from engine.generation.sampling import SamplingSettings
    from engine.hw import this_machine_policy
    from engine.session.engine import Engine, memory_factory_for

    policy = this_machine_policy()
    with tempfile.TemporaryDirectory(prefix="spark-bench-long-") as cache:
        factory = memory_factory_for(model, cache_dir=Path(cache), policy=policy)
        engine = Engine.load(model, backend, memory_factory=factory, policy=policy, quantize="auto")
        session = engine.new_session()
        settings = GenerationSettings(max_tokens=n_decode, sampling=SamplingSettings(greedy=True), ignore_eos=True)
        events = list(session.complete_ids(prompt_ids(vocab, tokens), settings))
        last = events[-1]
        return {
            "ttft_s": last.ttft_s,
            "decode_tps": last.tokens_per_s,
            "peak_rss_bytes": peak_rss_bytes(),
            "backend": engine.choice.explain(),
        }


def _ours(model: Path, tokens: int, n_decode: int, vocab: int, threads: int, backend: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "engine.bench.long_context", "--child", str(model)]
    cmd += ["--tokens", str(tokens), "--decode", str(n_decode), "--vocab", str(vocab), "--threads", str(threads)]
    cmd += ["--backend", backend]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SparkError(f"our {tokens}-token run failed: {last}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _theirs(gguf: Path, tokens: int, n_decode: int, vocab: int, threads: int) -> dict[str, Any]:
    peer = LlamaCppPeer(peer_environment(user_omp_wait_policy()))
    try:
        peer.load(gguf, n_ctx=tokens + n_decode + 8, threads=threads, n_batch=512)
        got = peer.measure(prompt_ids(vocab, tokens), n_decode)
        return {
            "ttft_s": tokens / got["prefill_tps"],
            "decode_tps": got["decode_tps"],
            "peak_rss_bytes": peer.peak_rss_bytes(),
        }
    finally:
        peer.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = args.threads or torch.get_num_threads()
    repeats = 1 if args.quick else 3
    n_decode = 16 if args.quick else DECODE_TOKENS
    model_dir = resolve_model_path(args.model)
    backend = getattr(args, "backend", None) or "cpu"  # ours on --backend (bench's default: cpu), llama.cpp on the CPU
    if not is_gguf_model(model_dir):
        raise SparkError("bench long-context compares both engines on one GGUF: pass --model FILE.gguf.")
    gguf = gguf_model(model_dir)
    vocab = gguf.config.vocab_size
    result: dict[str, Any] = {
        "model": display_name(model_dir),
        "gguf": str(gguf.path),
        "threads": threads,
        "decode_tokens": n_decode,
        "repeats": repeats,
    }
    if importlib.util.find_spec("llama_cpp") is None:
        raise SparkError("llama-cpp-python is not installed (pip install -e '.[bench]'); nothing to compare with.")
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {n: {"ours": [], "llamacpp": []} for n in LENGTHS}
    try:
        for _ in range(repeats):
            for n in LENGTHS:  # interleaved: a moment's load hits both engines alike
                runs[n]["ours"].append(_ours(model_dir, n, n_decode, vocab, threads, backend))
                runs[n]["llamacpp"].append(_theirs(gguf.path, n, n_decode, vocab, threads))
    except PeerError as exc:
        raise SparkError(f"llama.cpp failed: {exc}") from None
    result["backend"] = runs[LENGTHS[0]]["ours"][0]["backend"]

    def med(n: int, who: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[n][who]))

    for key, label in (("decode_tps", "decode_tps"), ("ttft_s", "ttft_s"), ("peak_rss_bytes", "peak_rss_mb")):
        for who in ("ours", "llamacpp"):
            scale = MB if key == "peak_rss_bytes" else 1
            result[f"{who}_{label}"] = {str(n): round(med(n, who, key) / scale, 3) for n in LENGTHS}
    result["decode_ratio_vs_llamacpp"] = {
        str(n): round(med(n, "ours", "decode_tps") / med(n, "llamacpp", "decode_tps"), 3) for n in LENGTHS
    }
    result["ttft_ratio_vs_llamacpp"] = {
        str(n): round(med(n, "llamacpp", "ttft_s") / med(n, "ours", "ttft_s"), 3) for n in LENGTHS
    }
    result["rss_ratio_vs_llamacpp"] = {
        str(n): round(med(n, "ours", "peak_rss_bytes") / med(n, "llamacpp", "peak_rss_bytes"), 3) for n in LENGTHS
    }
    if hasattr(os, "getloadavg"):
        result["load_average_1m"] = round(os.getloadavg()[0], 2)
    return result


def _main() -> None:
    p = argparse.ArgumentParser(prog="engine.bench.long_context")
    p.add_argument("--child", required=True, help="the model to run (our side of one measurement)")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--decode", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--backend", default="cpu")
    a = p.parse_args()
    from engine.hw import use_recommended_threads

    use_recommended_threads(a.threads)
    print(json.dumps(_ours_child(a.child, a.tokens, a.decode, a.vocab, a.backend)))


if __name__ == "__main__":
    _main()
