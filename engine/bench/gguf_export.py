"""Export a Llama-family model folder to GGUF so llama.cpp runs the very same weights and tokenizer.

llama.cpp's rotary embedding pairs adjacent channels while Hugging Face pairs channel i with i + D/2, so q_proj and
k_proj rows of llama/mistral models are permuted exactly as llama.cpp's own convert_hf_to_gguf.py does (qwen2 is
not permuted). Llama 3 rope scaling is written as llama.cpp's `rope_freqs` tensor. The tokenizer goes in as a gpt2
(byte-level BPE) vocabulary with its merges, specials and chat template.

The `gguf` package quantizes the legacy block types; for K-quants it has no quantizer, so a caller that wants them
passes its own `quantizer` (the tests write random valid blocks), or `quantize_with_llamacpp` writes the file
llama.cpp's own quantizer makes (a Q4_K_M as downloads have it) from an f32 export of the folder. From the
command line, with no download (the fp32 weights quantized once, never a quantized file quantized again):
    python -m engine.bench.gguf_export MODEL_DIR OUT.gguf --dtype q4_k_m
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import SparkError
from engine.loading.rotary_rows import reorder_rows
from engine.loading.weights import load_model
from engine.model.network import rope_inv_freq

# --dtype name -> (GGUF file type, tensor type of the 2-D weights); norms and biases always stay f32.
FILE_TYPES = {
    "f32": ("ALL_F32", "F32"),
    "f16": ("MOSTLY_F16", "F16"),
    "bf16": ("MOSTLY_BF16", "BF16"),
    "q8_0": ("MOSTLY_Q8_0", "Q8_0"),
    "q4_0": ("MOSTLY_Q4_0", "Q4_0"),
    "q4_1": ("MOSTLY_Q4_1", "Q4_1"),
    "q5_0": ("MOSTLY_Q5_0", "Q5_0"),
    "q5_1": ("MOSTLY_Q5_1", "Q5_1"),
    "q2_k": ("MOSTLY_Q2_K", "Q2_K"),
    "q3_k": ("MOSTLY_Q3_K_M", "Q3_K"),
    "q4_k": ("MOSTLY_Q4_K_M", "Q4_K"),
    "q5_k": ("MOSTLY_Q5_K_M", "Q5_K"),
    "q6_k": ("MOSTLY_Q6_K", "Q6_K"),
    "iq4_nl": ("MOSTLY_IQ4_NL", "IQ4_NL"),
    "iq4_xs": ("MOSTLY_IQ4_XS", "IQ4_XS"),
    "tq1_0": ("MOSTLY_TQ1_0", "TQ1_0"),
    "tq2_0": ("MOSTLY_TQ2_0", "TQ2_0"),
}
K_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")  # no quantizer in the gguf package
GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
# (rows, cols) float32 -> (rows, bytes) uint8 blocks of the given gguf.GGMLQuantizationType
Quantizer = Callable[[np.ndarray, Any], np.ndarray]

_GPT2_PRE = "default"
# --dtype name -> llama.cpp's file type (llama_cpp.LLAMA_FTYPE_*): its quantizer picks each tensor's type, falling
# back to Q5_0/Q5_1/Q8_0 for rows that are no multiple of 256 (SmolLM2's hidden size, 576).
LLAMACPP_TYPES = {
    "q2_k": "MOSTLY_Q2_K",
    "q3_k_m": "MOSTLY_Q3_K_M",
    "q4_k_m": "MOSTLY_Q4_K_M",
    "q4_k_s": "MOSTLY_Q4_K_S",
    "q5_k_m": "MOSTLY_Q5_K_M",
    "q6_k_llamacpp": "MOSTLY_Q6_K",
    "iq4_nl": "MOSTLY_IQ4_NL",
    "iq4_xs": "MOSTLY_IQ4_XS",
    "tq1_0": "MOSTLY_TQ1_0",
    "tq2_0": "MOSTLY_TQ2_0",
}


def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """(n_head*D, C) rows from HF half-split rotary order to llama.cpp's interleaved order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_quantize(a: np.ndarray, kind: Any) -> np.ndarray:
    import gguf

    return gguf.quants.quantize(a, kind)


def _copy_tokenizer(w: Any, model_path: Path) -> None:
    """A GGUF source's tokenizer fields, as they are (vocabulary, merges or scores, specials, chat template)."""
    import gguf

    from engine.loading.model_files import gguf_model

    for name, value, types in gguf_model(model_path).tokenizer_fields():
        if types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, gguf.GGUFValueType.ARRAY, sub_type=types[-1])
        else:
            w.add_key_value(name, value, types[0])


def _write_tokenizer(w: Any, model_dir: Path, vocab_size: int) -> None:
    """The folder's byte-level BPE tokenizer.json as a gpt2 GGUF vocabulary (padded to the model's vocab size)."""
    import gguf

    from engine.loading.model_files import is_gguf_model

    if is_gguf_model(model_dir):
        _copy_tokenizer(w, model_dir)
        return

    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise SparkError("The GGUF export writes byte-level BPE tokenizers; this model's tokenizer is of another kind.")
    by_id = {int(i): tok for tok, i in model["vocab"].items()}
    kinds = {i: gguf.TokenType.NORMAL for i in by_id}
    for added in data.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
        kinds[int(added["id"])] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [kinds.get(i, gguf.TokenType.UNUSED) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_GPT2_PRE)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    cfg = (
        json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        if (model_dir / "tokenizer_config.json").is_file()
        else {}
    )
    ids = {t: i for i, t in enumerate(tokens)}
    for key, setter in (
        ("bos_token", w.add_bos_token_id),
        ("eos_token", w.add_eos_token_id),
        ("pad_token", w.add_pad_token_id),
    ):
        text = cfg.get(key)
        text = text.get("content") if isinstance(text, dict) else text
        if isinstance(text, str) and text in ids:
            setter(ids[text])
    w.add_add_bos_token(bool(cfg.get("add_bos_token", False)))
    template = cfg.get("chat_template")
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, str):
        w.add_chat_template(template)


def export_gguf(
    model_dir: Path,
    out: Path,
    dtype: str = "f32",
    *,
    quantizer: Quantizer | None = None,
    sampling: Mapping[str, float | int] | None = None,
) -> Path:
    """`sampling`: `general.sampling.*` keys to write (temp, top_p, top_k, min_p, penalty_repeat, ...), as
    llama.cpp's converter writes a model's recommended sampling."""
    import gguf

    if dtype not in FILE_TYPES:
        raise SparkError(f"GGUF export knows {', '.join(FILE_TYPES)}, not {dtype!r}.")
    if dtype in K_TYPES and quantizer is None:
        raise SparkError(f"The gguf package cannot quantize to {dtype}; pass a quantizer for K-quants.")
    quantize = quantizer or _gguf_quantize
    loaded = load_model(model_dir, dtype=torch.float32)
    cfg, sd = loaded.config, loaded.model.state_dict()
    if cfg.o_bias or cfg.mlp_bias:
        raise SparkError("The GGUF export covers Llama/Qwen2 shapes; this model has output or MLP biases.")
    # Qwen2.5-VL's text model: Qwen2 with multimodal rotary, llama.cpp's `qwen2vl` (its vision part: mmproj_export)
    arch = "qwen2vl" if cfg.mrope_section else GGUF_ARCH[cfg.architecture]
    if arch == "gemma3" and cfg.query_scale is not None:
        raise SparkError("A Gemma 3 GGUF scales queries by head_dim**-0.5; this model's query_pre_attn_scalar differs.")
    permute = arch == "llama"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.rope_dim)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)  # Qwen3 and Gemma heads need not be hidden / heads wide
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling.factor)
    if cfg.mrope_section:  # llama.cpp stores four sections, the fourth empty for Qwen2-VL and Qwen2.5-VL
        w.add_rope_dimension_sections([*cfg.mrope_section, 0])
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)  # Gemma 3's layer pattern and local rope base are llama.cpp's own
    for key, value in (sampling or {}).items():
        if isinstance(value, int):
            w.add_int32(f"general.sampling.{key}", value)
        else:
            w.add_float32(f"general.sampling.{key}", value)
    file_type, qtype = FILE_TYPES[dtype]
    w.add_file_type(getattr(gguf.LlamaFileType, file_type))
    _write_tokenizer(w, model_dir, cfg.vocab_size)

    def put(name: str, t: torch.Tensor, keep_f32: bool = False) -> None:
        a = np.ascontiguousarray(t.detach().float().numpy())
        if keep_f32 or a.ndim == 1 or qtype == "F32":
            w.add_tensor(name, a)
        elif qtype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:  # block formats (and BF16): llama.cpp reads the raw bytes
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(name, quantize(a, kind), raw_dtype=kind)

    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "longrope":  # as llama.cpp's converter
        sc = cfg.rope_scaling
        w.add_rope_scaling_attn_factors(sc.attention_factor)
        w.add_rope_scaling_orig_ctx_len(sc.original_max_position_embeddings)
        put("rope_factors_long.weight", torch.tensor(sc.long_factors), keep_f32=True)
        put("rope_factors_short.weight", torch.tensor(sc.short_factors), keep_f32=True)
    if cfg.rotary_dims:  # q/k rows back in transformers' order (engine.loading.rotary_rows)
        for i in range(cfg.num_hidden_layers):
            for short, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
                key = f"model.layers.{i}.self_attn.{short}_proj.weight"
                sd[key] = reorder_rows(sd[key], heads, cfg.head_dim, cfg.rotary_dims, back=True)
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3":
        base = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
        put("rope_freqs.weight", base / rope_inv_freq(cfg), keep_f32=True)  # (D/2,) divisors, as llama.cpp stores them
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], keep_f32=True)
        if cfg.qk_norm:
            put(f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"], keep_f32=True)
            put(f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"], keep_f32=True)
        if cfg.sandwich_norms:  # Gemma's norms, holding 1 + w as llama.cpp's converter writes them
            put(f"blk.{i}.post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"], keep_f32=True)
            put(f"blk.{i}.ffn_norm.weight", sd[p + "pre_feedforward_layernorm.weight"], keep_f32=True)
            put(f"blk.{i}.post_ffw_norm.weight", sd[p + "post_feedforward_layernorm.weight"], keep_f32=True)
        else:
            put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], keep_f32=True)
        if arch == "phi3":  # fused, as Phi-3's own checkpoints and llama.cpp keep them
            qkv = [sd[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]
            put(f"blk.{i}.attn_qkv.weight", torch.cat(qkv))
            put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
            put(f"blk.{i}.ffn_up.weight", torch.cat((sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"])))
            put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
            continue
        for short, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads), ("v", 0)):
            for part in ("weight", "bias"):
                key = f"{p}self_attn.{short}_proj.{part}"
                if key not in sd:
                    continue
                t = sd[key]
                if permute and heads:
                    t = torch.from_numpy(np.ascontiguousarray(permute_for_gguf(t.numpy(), heads)))
                put(f"blk.{i}.attn_{short}.{part}", t)
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    put("output_norm.weight", sd["model.norm.weight"], keep_f32=True)
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def quantize_with_llamacpp(model_dir: Path, out: Path, dtype: str = "q4_k_m", threads: int = 1) -> Path:
    """`out` as llama.cpp's quantizer (llama-cpp-python, llama_model_quantize) writes it from an f32 export of
    `model_dir`. A GGUF source must hold float weights: quantizing an already quantized file again would measure
    the double rounding, not the format. SparkError in one sentence otherwise."""
    import ctypes
    import tempfile

    from engine.loading.model_files import gguf_model, is_gguf_model

    if dtype not in LLAMACPP_TYPES:
        raise SparkError(f"llama.cpp's quantizer here writes {', '.join(LLAMACPP_TYPES)}, not {dtype!r}.")
    if is_gguf_model(model_dir) and gguf_model(model_dir).stored_tensors():
        raise SparkError(
            f"{model_dir.name} already holds quantized weights; quantize from a float model (an HF folder or an "
            "f16/f32 GGUF), since quantizing twice is not the format llama.cpp users download."
        )
    try:
        import llama_cpp
    except ImportError:
        raise SparkError(
            "llama-cpp-python is not installed (pip install -e '.[bench]'); it writes K-quant files."
        ) from None
    with tempfile.TemporaryDirectory(prefix="spark-export-", dir=out.parent) as tmp:
        f32 = export_gguf(model_dir, Path(tmp) / "model-f32.gguf", "f32")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{LLAMACPP_TYPES[dtype]}")
        params.nthread = max(1, threads)
        rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise SparkError(f"llama.cpp's quantizer failed on {model_dir.name} (code {rc}).")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m engine.bench.gguf_export", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="a model folder (or a float GGUF)")
    p.add_argument("out", type=Path, help="the .gguf to write")
    p.add_argument("--dtype", default="f32", choices=[*FILE_TYPES.keys() - set(K_TYPES), *LLAMACPP_TYPES])
    p.add_argument("--threads", type=int, default=1, help="llama.cpp's quantizer threads")
    args = p.parse_args(argv)
    try:
        if args.dtype in LLAMACPP_TYPES:
            quantize_with_llamacpp(args.model, args.out, args.dtype, args.threads)
        else:
            export_gguf(args.model, args.out, args.dtype)
    except SparkError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
