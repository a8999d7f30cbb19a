"""Export a Llama-family model folder to GGUF (f32, f16, bf16, q8_0, q4_0 or q4_1) so llama.cpp runs the very same weights.

llama.cpp's rotary embedding pairs adjacent channels while Hugging Face pairs channel i with i + D/2, so q_proj and
k_proj rows are permuted exactly as llama.cpp's own convert_hf_to_gguf.py does. The benchmark checks the two
engines' logits agree, which proves the export is the same model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.errors import SparkError
from engine.weights import load_model


def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """(n_head*D, C) rows from HF half-split rotary order to llama.cpp's interleaved order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --dtype name -> (GGUF file type, tensor type of the 2-D weights); norms always stay f32.
FILE_TYPES = {
    "f32": ("ALL_F32", "F32"),
    "f16": ("MOSTLY_F16", "F16"),
    "bf16": ("MOSTLY_BF16", "BF16"),
    "q8_0": ("MOSTLY_Q8_0", "Q8_0"),
    "q4_0": ("MOSTLY_Q4_0", "Q4_0"),
    "q4_1": ("MOSTLY_Q4_1", "Q4_1"),
}


def export_gguf(model_dir: Path, out: Path, dtype: str = "f32") -> Path:
    import gguf

    loaded = load_model(model_dir, dtype=torch.float32)
    cfg, sd = loaded.config, loaded.model.state_dict()
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.rope_scaling is not None:
        raise SparkError("The GGUF export covers plain Llama shapes (no biases, no rope scaling); this model has them.")
    if dtype not in FILE_TYPES:
        raise SparkError(f"GGUF export knows {', '.join(FILE_TYPES)}, not {dtype!r}.")
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    file_type, qtype = FILE_TYPES[dtype]
    w.add_file_type(getattr(gguf.LlamaFileType, file_type))
    # A placeholder vocabulary: the benchmark feeds token ids directly, so only its size must match (llama.cpp
    # insists on at least one merge, hence "a" + "b" -> "ab").
    tokens = ["a", "b", "ab"] + [f"<t{i}>" for i in range(3, cfg.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)

    def put(name: str, t: torch.Tensor, keep_f32: bool = False) -> None:
        a = t.detach().float().numpy()
        if keep_f32 or a.ndim == 1 or qtype == "F32":
            w.add_tensor(name, a)
        elif qtype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:  # block formats: the gguf package quantizes, llama.cpp reads the raw bytes
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], keep_f32=True)
        q = permute_for_gguf(sd[p + "self_attn.q_proj.weight"].numpy(), cfg.num_attention_heads)
        k = permute_for_gguf(sd[p + "self_attn.k_proj.weight"].numpy(), cfg.num_key_value_heads)
        put(f"blk.{i}.attn_q.weight", torch.from_numpy(q))
        put(f"blk.{i}.attn_k.weight", torch.from_numpy(k))
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], keep_f32=True)
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
