"""`bench prefix-cache`: time to first token of a repeated 1,500-token prompt — cold, warm in the same process, and
warm after a process restart (a fresh interpreter over the same L3 cache dir). Headlines `speedup_warm` and
`speedup_restart` = cold TTFT / warm TTFT (goal >= 10).

TTFT here is prefill (with prefix reuse) plus the argmax of the last logits, model load excluded. The geometry is
the product's default for the model (CascadeConfig.for_model: the window covers the trained context, so the
prompt fits it): the warm runs restore the cold run's exact prefix blocks (engine.memory.cascade.core; a cascade.json
forcing a small window exercises its snapshots instead) and recompute only the tokens past their block-aligned end.
Default model: the default model (SmolLM2-135M-Instruct); --model for another.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.loading.model_files import display_name, resolve_model_path, settings_dir
from engine.memory.cascade import CascadeConfig, CascadeMemory, PersistentStore

PROMPT_TOKENS = 1500
CHUNK = 256


def ttft(model: Path, cache_dir: Path, backend_name: str, repeats: int = 1) -> list[dict[str, Any]]:
    """Load the model once, then `repeats` times: a fresh memory over `cache_dir`, prefill the prompt, argmax."""
    from engine.backends import open_backend
    from engine.generation.loop import prefill

    backend = open_backend(model, backend_name).backend
    cfg = CascadeConfig.for_model(settings_dir(model), backend.config)
    ids = torch.randint(
        0, backend.config.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    out = []
    for _ in range(repeats):
        store = PersistentStore(cache_dir, backend.fingerprint, backend.numerics)
        memory = CascadeMemory(backend, cfg, store=store)
        t0 = time.perf_counter()
        logits = prefill(backend, memory, ids, CHUNK)
        assert logits is not None  # None only when a should_stop ends the prefill early; there is none here
        token = int(logits.argmax())
        seconds = time.perf_counter() - t0
        out.append(
            {
                "ttft_s": seconds,
                "token": token,
                "logits_head": logits[:8].tolist(),
                "reused_tokens": memory.reused_tokens,
                "window": cfg.window,
                "l3_entries": store.stats().entries,
                "l3_bytes": store.bytes,
            }
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = getattr(args, "threads", None) or 1  # torch threads spin-wait on a busy machine (was 8x slower)
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model_path(args.model)
        cache = Path(tmp) / "l3"
        cold, warm = ttft(model, cache, args.backend or "cpu", repeats=2)
        cmd = [
            sys.executable,
            "-m",
            "engine.bench.prefix_cache",
            str(model),
            str(cache),
            args.backend or "cpu",
            str(threads),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            return {"error": f"the restarted process failed: {proc.stderr.strip().splitlines()[-1:]}"}
        restart = json.loads(proc.stdout)
    drift = max(abs(a - b) for a, b in zip(cold["logits_head"], restart["logits_head"], strict=True))
    return {
        "speedup_warm": cold["ttft_s"] / warm["ttft_s"],
        "speedup_restart": cold["ttft_s"] / restart["ttft_s"],
        "ttft_cold_s": cold["ttft_s"],
        "ttft_warm_s": warm["ttft_s"],
        "ttft_restart_s": restart["ttft_s"],
        "same_first_token": cold["token"] == warm["token"] == restart["token"],
        "max_logit_drift": drift,  # L3 holds fp16 KV; a backend computing in fp32 sees this much difference
        "reused_tokens_warm": warm["reused_tokens"],
        "reused_tokens_restart": restart["reused_tokens"],
        "l3_entries": restart["l3_entries"],
        "l3_bytes": restart["l3_bytes"],
        "prompt_tokens": PROMPT_TOKENS,
        "model": display_name(model),
        "window": cold["window"],
        "threads": threads,
    }


if __name__ == "__main__":  # the restarted process: same model, same cache dir
    model_arg, cache_arg, backend_arg, threads_arg = sys.argv[1:5]
    torch.set_num_threads(int(threads_arg))
    print(json.dumps(ttft(Path(model_arg), Path(cache_arg), backend_arg)[0]))
