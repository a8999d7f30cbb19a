"""llama.cpp's mtmd as `bench vision`'s peer, run by another interpreter (one where llama-cpp-python is built: the
bench's `--peer-python`), so it imports nothing of the engine, only llama_cpp, numpy and the standard library
(engine/bench/llamacpp_peer.py says why llama.cpp runs in a process of its own).

    PYTHON engine/bench/vision_peer.py --model TEXT.gguf --mmproj MMPROJ.gguf --prompt TEXT --threads N

`--prompt` holds `<image>` where the picture goes. Each line of standard input names a picture file; for each, one
JSON line on standard output: `encode_ms` (mtmd_encode_chunk over the picture's image chunks: the encoder and
projector), `ttft_ms` (from the file's bytes to the first token's logits: decoding the picture, preprocessing,
tokenizing, encoding and reading the prompt; greedy, a fresh context each time), `prompt_tokens` and `token` (the
greedy first token). A line `{"ready": true}` says the model is loaded.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from typing import Any

import numpy as np

MARKER = "<image>"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--mmproj", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ctx", type=int, default=4096)
    args = p.parse_args(argv)

    import llama_cpp
    from llama_cpp import mtmd_cpp

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=args.ctx,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    params = mtmd_cpp.mtmd_context_params_default()
    params.use_gpu = False
    params.print_timings = False
    params.n_threads = args.threads
    params.warmup = False  # the bench's first picture warms both engines up
    ctx = mtmd_cpp.mtmd_init_from_file(args.mmproj.encode(), llm.model, params)
    if not ctx:
        print(json.dumps({"error": f"mtmd could not load {args.mmproj}"}), flush=True)
        return 1
    prompt = args.prompt.replace(MARKER, mtmd_cpp.mtmd_default_marker().decode()).encode()
    print(json.dumps({"ready": True, "llama_cpp": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        path = line.strip()
        if path:
            print(json.dumps(ask(llama_cpp, mtmd_cpp, llm, ctx, prompt, path)), flush=True)
    mtmd_cpp.mtmd_free(ctx)
    return 0


def ask(llama_cpp: Any, mtmd_cpp: Any, llm: Any, ctx: Any, prompt: bytes, path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = f.read()
    t0 = time.perf_counter()
    buf = (ctypes.c_uint8 * len(data)).from_buffer(bytearray(data))
    bitmap = mtmd_cpp.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(data), False)
    text = mtmd_cpp.mtmd_input_text()
    text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), False, True
    chunks = mtmd_cpp.mtmd_input_chunks_init()
    bitmaps = (mtmd_cpp.mtmd_bitmap_p_ctypes * 1)(bitmap)
    if mtmd_cpp.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
        raise RuntimeError("mtmd could not tokenize the prompt")
    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    lctx = llm._ctx.ctx
    n_past = llama_cpp.llama_pos(0)
    encode_ms = 0.0
    count = mtmd_cpp.mtmd_input_chunks_size(chunks)
    for i in range(count):
        chunk = mtmd_cpp.mtmd_input_chunks_get(chunks, i)
        after = llama_cpp.llama_pos(n_past.value)  # a text chunk's evaluation adds its tokens to it
        if mtmd_cpp.mtmd_input_chunk_get_type(chunk) == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            te = time.perf_counter()
            if mtmd_cpp.mtmd_encode_chunk(ctx, chunk) != 0:
                raise RuntimeError("mtmd could not encode the picture")
            encode_ms += (time.perf_counter() - te) * 1000
            embd = mtmd_cpp.mtmd_get_output_embd(ctx)
            no_callback = mtmd_cpp.mtmd_helper_post_decode_callback(0)  # a NULL function pointer
            done = mtmd_cpp.mtmd_helper_decode_image_chunk(
                ctx, lctx, chunk, embd, n_past, 0, llm.n_batch, ctypes.byref(after), no_callback, None
            )
        else:
            done = mtmd_cpp.mtmd_helper_eval_chunk_single(
                ctx, lctx, chunk, n_past, 0, llm.n_batch, i == count - 1, ctypes.byref(after)
            )
        if done != 0:
            raise RuntimeError(f"llama.cpp could not read chunk {i} of the prompt")
        n_past = after
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
    token = int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(n_vocab,)).argmax())
    ttft_ms = (time.perf_counter() - t0) * 1000
    mtmd_cpp.mtmd_input_chunks_free(chunks)
    mtmd_cpp.mtmd_bitmap_free(bitmap)
    return {"encode_ms": encode_ms, "ttft_ms": ttft_ms, "prompt_tokens": int(n_past.value), "token": token}


if __name__ == "__main__":
    sys.exit(main())
