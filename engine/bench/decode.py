"""`bench decode`: prefill and decode tokens/s of our CPU path beside llama.cpp and transformers, same run.

Every engine gets the same weights (our safetensors; llama.cpp a GGUF export of them at our precision, checked by
comparing logits), the same thread count, the same prompt ids and greedy decoding of the same number of tokens.
Precision: our fp32 path is compared with an F32 GGUF, our block formats (`--quantize q8_0|q4_0|q4_1`; `auto`, the
CPU default, is Q8_0 for a model folder) with a GGUF export of the same type, whose bytes are the ones we hold;
`--gguf FILE` runs that file in both engines, ours as stored (engine.loading.gguf). transformers runs its CPU
default, fp32, and the output says so. Our activations keep more bits than llama.cpp's Q8 blocks, so logits differ
slightly and the tokens are compared but may part at near-ties.
Runs are interleaved (ours, llama.cpp, transformers, repeat) and the median is reported, so background load hits
every peer alike. Default model: the default model's GGUF, which both engines run as stored (ours with
`--quantize auto`), and transformers dequantized to fp32. llama.cpp runs in a process of its own, with the
environment the user gave (engine.bench.llamacpp_peer says why); transformers runs in ours, under the engine's
OpenMP policy.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.backends import BackendChoice
from engine.backends.base import Backend
from engine.backends.torch_backend import TorchBackend
from engine.bench.llamacpp_peer import LlamaCppPeer, PeerError, peer_environment
from engine.errors import SparkError
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.model_files import display_name, gguf_model, is_gguf_model, resolve_model_path
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory
from engine.process import user_omp_wait_policy
from engine.session.engine import Engine, MemoryFactory, Session

# Our precision -> the GGUF tensor type llama.cpp runs for the same comparison.
GGUF_TYPE_FOR: dict[str, str] = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "q8_0": "q8_0",
    "q5_0": "q5_0",
    "q4_0": "q4_0",
    "q4_1": "q4_1",
}

PROMPT_TOKENS = 128
DECODE_TOKENS = 128


def full_attention_memory(slots: int) -> MemoryFactory:
    """Each conversation gets plain full attention over a slot table of `slots` (no cascade, no L3)."""

    def make(backend: Backend) -> Memory:
        backend.allocate(1, slots)
        return FullAttentionMemory(backend)

    return make


def prompt_ids(vocab: int, n: int = PROMPT_TOKENS) -> list[int]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(1, min(vocab, 30000), (n,), generator=g).tolist()


def measure_ours(session: Session, ids: list[int], n_decode: int) -> dict[str, Any]:
    session.reset()
    settings = GenerationSettings(
        max_tokens=n_decode, sampling=SamplingSettings(greedy=True), prefill_chunk=len(ids), ignore_eos=True
    )
    events = list(session.complete_ids(ids, settings))
    last = events[-1]
    return {"prefill_tps": len(ids) / last.ttft_s, "decode_tps": last.tokens_per_s, "tokens": [e.token for e in events]}


def measure_transformers(model, ids: list[int], n_decode: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]  # model: a transformers model, an optional import
    inp = torch.tensor([ids])
    kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None, "attention_mask": torch.ones_like(inp)}
    t0 = time.perf_counter()
    model.generate(inp, max_new_tokens=1, min_new_tokens=1, **kw)
    t1 = time.perf_counter()
    out = model.generate(inp, max_new_tokens=n_decode, min_new_tokens=n_decode, **kw)
    t2 = time.perf_counter()
    # decode rate = the extra tokens over the extra time of the longer run
    return {
        "prefill_tps": len(ids) / (t1 - t0),
        "decode_tps": (n_decode - 1) / ((t2 - t1) - (t1 - t0)),
        "tokens": out[0, len(ids) :].tolist(),
    }


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    repeats = 1 if args.quick else 3
    n_decode = 32 if args.quick else DECODE_TOKENS
    tmp = tempfile.TemporaryDirectory(prefix="spark-bench-")
    model_dir = resolve_model_path(args.model)  # the default model unless --model names another
    # Ours runs on --backend (coreml, mlx, mps, cuda or cpu); the peers always run on the CPU with the same threads.
    # Full attention, like both peers: this measures the engine core; `bench cascade` measures the memory cascade.
    memory = full_attention_memory(PROMPT_TOKENS + n_decode + 8)
    gguf_file = getattr(args, "gguf", None)
    if gguf_file is not None:  # ours runs the file's blocks as stored (until the GGUF loader opens the file itself)
        stored = gguf_model(gguf_file).stored_tensors()
        choice = BackendChoice(TorchBackend(model_dir, "cpu", quantize=args.quantize, stored=stored), ())
        engine = Engine(choice, Tokenizer.load(model_dir), model_dir, memory)
    else:
        engine = Engine.load(model_dir, args.backend, memory_factory=memory, quantize=args.quantize)
    ids = prompt_ids(engine.backend.config.vocab_size)
    dtype = (
        str(getattr(engine.backend, "dtype", "float16")).removeprefix("torch.").removeprefix("mlx.core.")
    )  # Core ML: fp16
    quantize = getattr(engine.backend, "quantize", "none") or "none"
    gguf_type = GGUF_TYPE_FOR.get(quantize, GGUF_TYPE_FOR.get(dtype, "f16"))
    result: dict[str, Any] = {
        "model": display_name(model_dir),
        "threads": threads,
        "prompt_tokens": len(ids),
        "decode_tokens": n_decode,
        "backend": engine.choice.explain(),
        "dtype": dtype,
        "quantize": quantize,
        "numerics": engine.backend.numerics,
    }
    session = engine.new_session()
    peers: dict[str, Callable[[], dict[str, Any]]] = {"ours": lambda: measure_ours(session, ids, n_decode)}
    notes = []
    peer: LlamaCppPeer | None = None
    if importlib.util.find_spec("llama_cpp") is None:  # only the peer process loads it
        notes.append("llama-cpp-python is not installed (pip install -e '.[bench]'); llama.cpp was not measured")
    else:
        try:
            from engine.bench.gguf_export import export_gguf

            if gguf_file is not None:
                gguf_path = Path(gguf_file)
                result["gguf"] = str(gguf_path)
            elif is_gguf_model(model_dir) and args.quantize == "auto":  # both engines run the file as it is
                gguf_path = gguf_model(model_dir).path
                result["gguf"] = str(gguf_path)
            else:
                gguf_path = export_gguf(model_dir, Path(tmp.name) / f"model-{gguf_type}.gguf", gguf_type)
                result["llamacpp_gguf_type"] = gguf_type
            peer = LlamaCppPeer(peer_environment(user_omp_wait_policy()))
            result["llamacpp_version"] = peer.load(
                gguf_path, n_ctx=len(ids) + n_decode + 8, threads=threads, n_batch=len(ids)
            )
            llamacpp = peer
            peers["llamacpp"] = lambda: llamacpp.measure(ids, n_decode)
            # Same model? Compare the prompt's last-token logits of both engines.
            theirs = torch.from_numpy(peer.last_logits(ids))
            ours_logits = _our_last_logits(engine, ids)
            result["llamacpp_max_logit_diff"] = float((theirs - ours_logits).abs().max())
        except (SparkError, PeerError) as exc:  # a shape the GGUF export does not cover; the peer failed
            notes.append(f"llama.cpp was not measured: {exc}")
            peers.pop("llamacpp", None)
    try:
        import transformers

        file = gguf_model(model_dir).path if is_gguf_model(model_dir) else None  # transformers dequantizes a GGUF
        where = (file.parent, {"gguf_file": file.name}) if file else (model_dir, {})
        hf = transformers.AutoModelForCausalLM.from_pretrained(where[0], dtype=torch.float32, **where[1]).eval()
        peers["transformers"] = lambda: measure_transformers(hf, ids, n_decode)
        result["transformers_version"] = transformers.__version__
        result["transformers_dtype"] = "float32"
    except ImportError:
        notes.append("transformers is not installed; it was not measured")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in peers}
    with torch.inference_mode():
        for fn in peers.values():  # warm-up (allocations, thread pools, lazy init)
            fn()
        for _ in range(repeats):
            for name, fn in peers.items():
                runs[name].append(fn())
    for name, rs in runs.items():
        result[f"{name}_prefill_tps"] = round(_median(rs, "prefill_tps"), 1)
        result[f"{name}_decode_tps"] = round(_median(rs, "decode_tps"), 1)
    for name in runs:
        if name != "ours":
            result[f"{name}_same_tokens"] = runs[name][-1]["tokens"] == runs["ours"][-1]["tokens"]
    if "llamacpp" in runs:
        result["ratio_vs_llamacpp"] = round(result["ours_decode_tps"] / result["llamacpp_decode_tps"], 3)
        result["prefill_ratio_vs_llamacpp"] = round(result["ours_prefill_tps"] / result["llamacpp_prefill_tps"], 3)
        # Each repeat's ratio (its runs are adjacent, so they share that moment's load): the spread behind the median.
        pairs = list(zip(runs["ours"], runs["llamacpp"], strict=True))
        result["ratio_vs_llamacpp_runs"] = [round(o["decode_tps"] / t["decode_tps"], 3) for o, t in pairs]
        result["prefill_ratio_vs_llamacpp_runs"] = [round(o["prefill_tps"] / t["prefill_tps"], 3) for o, t in pairs]
    if "transformers" in runs:
        result["ratio_vs_transformers"] = round(result["ours_decode_tps"] / result["transformers_decode_tps"], 3)
    if hasattr(os, "getloadavg"):  # what else ran: ratios taken on a loaded machine say so
        result["load_average_1m"] = round(os.getloadavg()[0], 2)
    if notes:
        result["notes"] = notes
    if peer is not None:
        peer.close()
    tmp.cleanup()
    return result


def _our_last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    from engine.generation.loop import prefill

    session = engine.new_session()
    logits = prefill(session.backend, session.memory, ids, len(ids))
    assert logits is not None  # None only when a should_stop ends the prefill early; there is none here
    return logits
