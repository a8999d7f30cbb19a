"""`bench quant`: how faithful each block format is to our fp32 path, beside llama.cpp on the same text and bytes.

For every type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and `--gguf FILE` as stored) both engines run the very same GGUF: the model
folder's fp32 weights exported at that type (engine.bench.gguf_export; our own quantizer writes identical bytes),
(Q5_1 by the gguf package's quantizer), read back as StoredTensor (engine.loading.gguf) for us and loaded by llama.cpp (llama-cpp-python, logits for every
token). Over >= 2,048 tokens of held-out text, each is compared with our fp32 logits: mean and 99th-percentile KL
divergence, same top token, perplexity. Headline `kld_ratio_vs_llamacpp` (ours / theirs) per type and worst; goal
<= 1.0. Our kernels quantize activations per block of 32 as int16 with one scale (`ours_*`); the same weights
also run with llama.cpp's int8 (Q8) activations (`ours_q8_act_*`) and with fp32 activations (`ours_fp32_act_*`), which
is how the default was chosen. The ternary files (OWN_REFERENCE) are compared with their own weights at fp32 instead,
as a BitNet b1.58 model is, whose ternary weights are the model (`reference`, `reference_ppl`); their divergence from
the model's fp32 logits is `*_vs_model_*`.

The formats with no quantizer here (the K-quant mixes, IQ4_NL/IQ4_XS, TQ1_0/TQ2_0) are written from the folder's fp32
weights by llama.cpp's own quantizer when llama-cpp-python is installed (LLAMACPP_FILES: a file as downloads have
it, e.g. a Q4_K_M's tensors mix Q4_K, Q6_K and, where a row is no multiple of 256, Q5_0 and Q8_0), and both
engines run that file. On a model whose rows are no multiple of 256 (the default model's 576) llama.cpp's Q2_K file
holds Q3_K and Q4_0 only (its Q2_K_S, which keeps Q2_K in the down projections, needs an importance matrix that
llama-cpp-python cannot pass), so Q2_K is measured only on models whose rows allow it. A file llama.cpp's
quantizer refuses is named in `notes` and the others still run. `by_block_type` names, for every block type the
engine runs as stored, the file holding most of its tensors and both engines' figures on that file;
`block_types_missing` lists any type no file held.

`--kv-type q8_0` measures the KV cache type instead: the model's weights as stored (the default model's GGUF, or
`--gguf`) read the held-out text through the slot table with q8_0 keys and values, against the same with fp16 ones
(`kv_q8_0_*`: mean and p99 KLD, same top token, perplexity), and llama.cpp likewise with its type_k/type_v q8_0
against its f16 cache (flash attention on in both, as llama.cpp needs it for a quantized V cache);
`kv_kld_ratio_vs_llamacpp` is ours over theirs. Any other file: --gguf FILE (quantized from float weights, as
`python -m engine.bench.gguf_export MODEL_DIR OUT.gguf --dtype q4_k_m` writes it).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.backends.torch_backend import TorchBackend
from engine.errors import SparkError
from engine.heldout.docs import held_out_text
from engine.loading.model_files import gguf_model, is_gguf_model, resolve_model_path
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory
from engine.model.kv_types import KVType
from engine.model.quant import BlockType, StoredTensor

TOKENS = 2048
QUICK_TOKENS = 256
# Files the export writes (our quantizer's formats, and Q5_1 from the gguf package's).
TYPES = (*(t.name.lower() for t in BlockType if t.quantizable), "q5_1")
# Files llama.cpp's quantizer writes (engine.bench.gguf_export.LLAMACPP_TYPES): every other format we run as stored.
LLAMACPP_FILES = ("q2_k", "q3_k_m", "q4_k_m", "q5_k_m", "q6_k_llamacpp", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0")
# Ternary files: weights of a model not trained for them lose it (same top token < 1 %: both engines' divergences
# from it are noise around KLD 13), while a BitNet b1.58 model's ternary weights are the model. Their rows are
# measured as such a model is: against the file's own weights at fp32; the divergence from the model is kept beside.
OWN_REFERENCE = ("tq1_0", "tq2_0")


def held_out_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    """n + 1 token ids of held-out text (the last one is only a target)."""
    ids = tokenizer.encode(held_out_text(8 * n))
    if len(ids) < n + 1:
        raise SparkError(f"The held-out text gave {len(ids)} tokens, fewer than the {n + 1} needed.")
    return ids[: n + 1]


def compare(ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """ref_logits, logits (T, V); targets (T,): KL(ref || this) per token, top-token agreement, perplexity."""
    kld, ce = [], []
    for at in range(0, ref_logits.shape[0], 256):  # chunks: (256, V) at a time in float64
        p = torch.log_softmax(ref_logits[at : at + 256].double(), -1)
        q = torch.log_softmax(logits[at : at + 256].double(), -1)
        kld.append((p.exp() * (p - q)).sum(-1))
        ce.append(-q.gather(1, targets[at : at + 256, None])[:, 0])
    k = torch.cat(kld)
    return {
        "mean_kld": float(k.mean()),
        "p99_kld": float(torch.quantile(k, 0.99)),
        "same_top": float((ref_logits.argmax(-1) == logits.argmax(-1)).double().mean()),
        "ppl": float(torch.cat(ce).mean().exp()),
    }


def file_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """What a GGUF's own weights say at fp32: the file dequantized, run by our fp32 path -> logits (T, V)."""
    return our_logits(TorchBackend(path, "cpu", quantize="none"), ids)


def our_logits(backend: TorchBackend, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return backend.model.forward_causal(torch.tensor([ids]))[0].float()  # (T, V)


def slot_table_logits(backend: TorchBackend, ids: list[int]) -> torch.Tensor:
    """ids through the slot table in one step (keys and values written, then read back as the table holds them,
    so its KV type takes part) -> logits (T, V)."""
    backend.allocate(1, len(ids))
    memory = FullAttentionMemory(backend)
    with torch.inference_mode():
        logits = backend.forward(torch.tensor([ids]), memory.plan(ids).as_batch())
    return logits[0].float()  # (T, V)


def llamacpp_logits(path: Path, ids: list[int], threads: int, kv_type: KVType | None = None) -> torch.Tensor:
    """llama.cpp's logits (T, V); with a `kv_type`, its cache in that type under flash attention (which a quantized
    V cache needs; the f16 reference takes it too, so that only the cache type differs)."""
    import llama_cpp

    cache: dict[str, Any] = {}
    if kv_type is not None:  # ggml's type ids
        ggml = llama_cpp.GGML_TYPE_Q8_0 if kv_type is KVType.Q8_0 else llama_cpp.GGML_TYPE_F16
        cache = {"type_k": ggml, "type_v": ggml, "flash_attn": True}
    llm = llama_cpp.Llama(
        str(path),
        n_ctx=len(ids) + 8,
        n_batch=512,
        n_ubatch=512,
        logits_all=True,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
        **cache,
    )
    llm.eval(ids)
    out = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))  # (T, V)
    llm.close()
    return out


def _rounded(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {f"{prefix}_{k}": round(v, 6) for k, v in d.items()}


def by_block_type(rows: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """rows: file name -> its row (with `tensor_counts`). Each block type -> the row of the file holding most of its
    tensors (which file, how many, both engines' mean KLD and same-top rate there); and the types no file held."""
    figures = ("ours_mean_kld", "llamacpp_mean_kld", "ours_same_top", "llamacpp_same_top", "kld_ratio_vs_llamacpp")
    out: dict[str, dict[str, Any]] = {}
    for qtype in (t.gguf_name for t in BlockType):
        held = [(row["tensor_counts"].get(qtype, 0), name) for name, row in rows.items()]
        count, name = max(held, default=(0, ""))
        if count:
            out[qtype] = {"file": name, "tensors": count} | {k: rows[name][k] for k in figures if k in rows[name]}
    return out, [t.gguf_name for t in BlockType if t.gguf_name not in out]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if KVType(getattr(args, "kv_type", "f16")) is KVType.Q8_0:
        return run_kv(args)
    model = resolve_model_path(args.model)  # its fp32 weights (a GGUF's, dequantized) are the reference
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    n = QUICK_TOKENS if args.quick else TOKENS
    ids = held_out_ids(Tokenizer.load(model), n)
    inputs, targets = ids[:-1], torch.tensor(ids[1:])
    result: dict[str, Any] = {"model": str(model), "tokens": len(inputs), "threads": threads, "types": {}}
    t0 = time.perf_counter()
    fp32 = our_logits(TorchBackend(model, "cpu", quantize="none"), inputs)
    result["ours_fp32_ppl"] = round(compare(fp32, fp32, targets)["ppl"], 4)
    try:
        import llama_cpp

        from engine.bench.gguf_export import export_gguf

        result["llamacpp_version"] = llama_cpp.__version__
        have_llamacpp = True
    except ImportError:
        have_llamacpp = False
        result["notes"] = ["llama-cpp-python is not installed (pip install -e '.[bench]'); llama.cpp was not measured"]
    tmp = tempfile.TemporaryDirectory(prefix="spark-quant-")
    files: dict[str, Path] = {}
    for name in TYPES:
        files[name] = export_gguf(model, Path(tmp.name) / f"model-{name}.gguf", name)
    if have_llamacpp:
        from engine.bench.gguf_export import quantize_with_llamacpp

        f32 = export_gguf(model, Path(tmp.name) / "model-f32.gguf", "f32")
        result["llamacpp_f32"] = _rounded(
            compare(fp32, llamacpp_logits(f32, inputs, threads), targets), "llamacpp"
        )  # the peers agree at fp32
        for name in LLAMACPP_FILES:  # from the fp32 weights our reference runs (a quantized model's, dequantized)
            try:
                files[name] = quantize_with_llamacpp(f32, Path(tmp.name) / f"model-{name}.gguf", name, threads)
            except SparkError as exc:
                result.setdefault("notes", []).append(f"{name} was not measured: {exc}")
        f32.unlink()
    if args.gguf:
        files["gguf"] = Path(args.gguf)
    elif is_gguf_model(model):
        files["gguf"] = model  # the file as it is: its own blocks, as stored, in both engines
    for name, path in files.items():
        stored: dict[str, StoredTensor] = gguf_model(path).stored_tensors()
        made = "llama.cpp's quantizer" if name in LLAMACPP_FILES else "export"
        row: dict[str, Any] = {"file": str(path) if name == "gguf" else f"{name} {made} of the model's fp32 weights"}
        row["formats"] = sorted({t.qtype for t in stored.values()})
        row["tensor_counts"] = dict(Counter(t.qtype for t in stored.values()))
        ref = fp32
        if name in OWN_REFERENCE:
            ref = file_logits(path, inputs)
            row["reference"] = "the file's own weights at fp32"
            row["reference_ppl"] = round(compare(ref, ref, targets)["ppl"], 4)
        ours = TorchBackend(model, "cpu", quantize="auto", stored=stored)
        row["ours_weights"] = ours.numerics
        logits = our_logits(ours, inputs)
        del ours
        row.update(_rounded(compare(ref, logits, targets), "ours"))
        if ref is not fp32:
            row.update(_rounded(compare(fp32, logits, targets), "ours_vs_model"))
        q8_act = TorchBackend(model, "cpu", quantize="auto", stored=stored, act_parts=1)  # llama.cpp's activations
        row.update(_rounded(compare(ref, our_logits(q8_act, inputs), targets), "ours_q8_act"))
        del q8_act
        fp32_act = TorchBackend(
            model, "cpu", quantize="auto", stored=stored, kernels="torch"
        )  # same weights, fp32 activations
        row.update(_rounded(compare(ref, our_logits(fp32_act, inputs), targets), "ours_fp32_act"))
        del fp32_act
        if have_llamacpp:
            logits = llamacpp_logits(path, inputs, threads)
            row.update(_rounded(compare(ref, logits, targets), "llamacpp"))
            if ref is not fp32:
                row.update(_rounded(compare(fp32, logits, targets), "llamacpp_vs_model"))
            row["kld_ratio_vs_llamacpp"] = round(row["ours_mean_kld"] / row["llamacpp_mean_kld"], 3)
        for who in ("ours", "ours_q8_act", "ours_fp32_act", "llamacpp"):
            if f"{who}_ppl" in row:
                row[f"{who}_ppl_delta_pct"] = round(100 * (row[f"{who}_ppl"] / result["ours_fp32_ppl"] - 1), 3)
        result["types"][name] = row
    result["by_block_type"], result["block_types_missing"] = by_block_type(result["types"])
    ratios = [r["kld_ratio_vs_llamacpp"] for r in result["types"].values() if "kld_ratio_vs_llamacpp" in r]
    if ratios:
        result["kld_ratio_vs_llamacpp"] = {name: r["kld_ratio_vs_llamacpp"] for name, r in result["types"].items()}
        result["worst_kld_ratio_vs_llamacpp"] = max(ratios)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    tmp.cleanup()
    return result


def run_kv(args: argparse.Namespace) -> dict[str, Any]:
    """`--kv-type q8_0`: q8_0 keys and values against fp16 ones, ours and llama.cpp's, on the same weights."""
    model = resolve_model_path(args.model)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    n = QUICK_TOKENS if args.quick else TOKENS
    ids = held_out_ids(Tokenizer.load(model), n)
    inputs, targets = ids[:-1], torch.tensor(ids[1:])
    path = Path(args.gguf) if args.gguf else (gguf_model(model).path if is_gguf_model(model) else None)
    stored = gguf_model(path).stored_tensors() if path is not None else None
    result: dict[str, Any] = {"model": str(model), "tokens": len(inputs), "threads": threads, "kv_type": "q8_0"}
    t0 = time.perf_counter()
    runs = {}
    for kv in (KVType.F16, KVType.Q8_0):
        backend = TorchBackend(model, "cpu", quantize="auto", stored=stored, kv_type=kv)
        result["ours_weights"] = backend.numerics
        runs[kv] = slot_table_logits(backend, inputs)
        del backend
    result.update(_rounded(compare(runs[KVType.F16], runs[KVType.Q8_0], targets), "kv_q8_0"))
    if path is None:
        result["notes"] = ["llama.cpp was not measured: the model is no GGUF (pass --gguf FILE of its weights)"]
    else:
        try:
            import llama_cpp

            result["llamacpp_version"] = llama_cpp.__version__
            f16 = llamacpp_logits(path, inputs, threads, KVType.F16)
            q8 = llamacpp_logits(path, inputs, threads, KVType.Q8_0)
            result.update(_rounded(compare(f16, q8, targets), "llamacpp_kv_q8_0"))
            result["kv_kld_ratio_vs_llamacpp"] = round(
                result["kv_q8_0_mean_kld"] / result["llamacpp_kv_q8_0_mean_kld"], 3
            )
        except ImportError:
            result["notes"] = [
                "llama-cpp-python is not installed (pip install -e '.[bench]'); llama.cpp was not measured"
            ]
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result
