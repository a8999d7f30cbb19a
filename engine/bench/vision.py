"""`bench vision`: what a question about a picture costs, beside transformers on the same folder in the same run.

- `encode_ms`: the vision encoder (SigLIP, then SmolVLM's pixel shuffle and connector or Gemma 3's pooling and
  projector) over one 896x896 picture's frames (after the processor's tiling: for SmolVLM, 4 x 4 tiles and the
  global view; Gemma 3 takes one frame);
- `ttft_ms`: a chat question about that picture, from the request to its first token: decoding the picture,
  preprocessing, encoding and reading the prompt (no prefix cache, a picture not seen before);
- `ratio_vs_peer`: transformers' time ÷ ours for each (above 1: we are faster), with `peer_encode_ms` and
  `peer_ttft_ms` (its processor, the folder's `Idefics3ForConditionalGeneration` or `Gemma3ForConditionalGeneration`
  in fp32, one forward for the first token).

The peer is transformers: our engine reads vision models from Hugging Face folders, not GGUF + mmproj, so
llama.cpp's mtmd has no file of ours to run. Each figure is the median over fresh pictures (the encoder's output is
kept per picture, so a picture seen before would cost nothing), the two engines alternating picture by picture. Without `--model` the folder is random weights at
SmolVLM-256M-Instruct's shapes written by transformers (`write_smolvlm_shapes`; weights do not change speed, and
nothing is downloaded).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from engine.bench.checkpoints import byte_level_vocabulary
from engine.errors import SparkError
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.model_files import display_name, resolve_model_path
from engine.session.engine import Engine, load
from engine.vision.images import decode_bytes
from engine.vision.model import is_vision_folder

SIDE = 896
QUESTION = "What is in this picture?"
FIRST_TOKEN = GenerationSettings(max_tokens=1, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))
# SmolVLM's own chat template (its content parts: text and image)
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
IDEFICS3_TOKENS = ["<|endoftext|>", "<|im_start|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>"]
IDEFICS3_TOKENS += ["<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]


def write_smolvlm_shapes(out: Path, seed: int = 0) -> Path:
    """A SmolVLM-256M-Instruct-shaped folder (SigLIP-B/16 at 512 px, pixel shuffle by 4, SmolLM2-135M's text model,
    its processor's sizes) with random weights and a byte-level vocabulary, written by transformers."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab_size = 49280
    vocab, merges = byte_level_vocabulary(vocab_size - len(IDEFICS3_TOKENS) + 1)  # its <|endoftext|> is ours
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(IDEFICS3_TOKENS)
    work = out / "_tok"
    work.mkdir(parents=True, exist_ok=True)
    tok.save(str(work / "tokenizer.json"))
    (work / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>", "add_bos_token": False})
    )
    hf_tok = transformers.AutoTokenizer.from_pretrained(work)
    text = {
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": False,
        "bos_token_id": tok.token_to_id("<|im_start|>"),
        "eos_token_id": tok.token_to_id("<end_of_utterance>"),
        "pad_token_id": 0,
    }
    vision = {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "image_size": 512,
        "patch_size": 16,
    }
    cfg = transformers.Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=4,
        image_token_id=tok.token_to_id("<image>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 1:
                torch.nn.init.normal_(p, 1.0, 0.02)
            else:
                torch.nn.init.normal_(p, 0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    processor = transformers.Idefics3Processor(
        image_processor=transformers.Idefics3ImageProcessorPil(
            size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}, do_image_splitting=True
        ),
        tokenizer=hf_tok,
        image_seq_len=64,
        chat_template=SMOLVLM_TEMPLATE,
    )
    processor.save_pretrained(out)
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    return out


def noise_picture(seed: int) -> bytes:
    """An 896x896 PNG of noise: every picture another (so nothing is kept from an earlier one)."""
    a = np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a, "RGB").save(buf, "PNG")
    return buf.getvalue()


class Stopwatch:
    """Time from a module's first call's start to another's end (forward hooks): the encoder inside a prefill."""

    def __init__(self, first: torch.nn.Module, last: torch.nn.Module) -> None:
        self.ms: list[float] = []
        self._t0 = 0.0
        first.register_forward_pre_hook(self._start)
        last.register_forward_hook(self._stop)

    def _start(self, *_: object) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, *_: object) -> None:
        self.ms.append((time.perf_counter() - self._t0) * 1000)


class Ours:
    """Our engine: a chat question about a picture, timed to its first token, and its encoder inside that."""

    def __init__(self, engine: Engine) -> None:
        assert engine.vision is not None
        self.engine = engine
        self.watch = Stopwatch(engine.vision.tower, engine.vision.tower)  # called once per frame
        self.prompt_tokens = 0

    def ask(self, data: bytes) -> tuple[float, float]:
        """(encode ms, ttft ms) for a question about the picture `data`."""
        session = self.engine.new_session()
        self.watch.ms.clear()
        t0 = time.perf_counter()
        ttft = 0.0
        for ev in session.chat(QUESTION, FIRST_TOKEN, images=[decode_bytes(data)]):
            if ev.token is not None:
                ttft = (time.perf_counter() - t0) * 1000
                break
        self.prompt_tokens = len(session.memory.tokens)  # the prompt (the first token is sampled, not yet fed)
        return sum(self.watch.ms), ttft


# architecture -> the encoder's first and last modules in transformers' model (`.model.<name>`)
PEER_ENCODERS = {
    "Idefics3ForConditionalGeneration": ("vision_model", "connector"),
    "Gemma3ForConditionalGeneration": ("vision_tower", "multi_modal_projector"),
}


class Peer:
    """transformers' model of the same folder (Idefics3, Gemma 3): its processor and one forward for the first
    token."""

    def __init__(self, folder: Path) -> None:
        import transformers

        arch = json.loads((folder / "config.json").read_text(encoding="utf-8"))["architectures"][0]
        model_class = getattr(transformers, arch)
        self.model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
        self.processor = transformers.AutoProcessor.from_pretrained(folder)
        first, last = PEER_ENCODERS[arch]
        self.watch = Stopwatch(getattr(self.model.model, first), getattr(self.model.model, last))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        self.prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        # A template that writes BOS itself: the tokenizer adds none (as ours, and apply_chat_template's tokenizing)
        bos = self.processor.tokenizer.bos_token
        self.special = not (bos and self.prompt.startswith(bos))
        self.prompt_tokens = 0

    def ask(self, data: bytes) -> tuple[float, float]:
        self.watch.ms.clear()
        t0 = time.perf_counter()
        image = Image.open(io.BytesIO(data)).convert("RGB")
        inputs = self.processor(text=self.prompt, images=[image], return_tensors="pt", add_special_tokens=self.special)
        with torch.no_grad():
            int(self.model(**inputs).logits[0, -1].argmax())
        ttft = (time.perf_counter() - t0) * 1000
        self.prompt_tokens = int(inputs["input_ids"].shape[1])
        return sum(self.watch.ms), ttft


def median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import transformers  # noqa: F401  (the peer)
    except ImportError:
        raise SparkError("bench vision needs transformers, its peer; install the bench extra.") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = 1 if args.quick else 3
    pictures = [noise_picture(seed) for seed in range(reps + 1)]  # the first warms both engines up
    with tempfile.TemporaryDirectory(prefix="spark-bench-vision-") as tmp:
        if args.model is None:
            folder, name = write_smolvlm_shapes(Path(tmp) / "smolvlm"), "random weights, SmolVLM-256M-Instruct shapes"
        else:
            folder = resolve_model_path(args.model)
            name = display_name(folder)
            if not is_vision_folder(folder):
                raise SparkError(f"{name} is not a vision model folder this engine runs (SmolVLM, Gemma 3).")
        quantize = "none" if args.quantize == "auto" else args.quantize  # the peer runs fp32
        ours, theirs = Ours(load(folder, args.backend, quantize=quantize, prefix_cache=False)), Peer(folder)
        # Alternated picture by picture, so a machine whose load drifts weighs on both alike; the first warms up.
        timings = [(ours.ask(data), theirs.ask(data)) for data in pictures]
    encode = [o[0] for o, _ in timings[1:]]
    ttft = [o[1] for o, _ in timings[1:]]
    peer_encode = [p[0] for _, p in timings[1:]]
    peer_ttft = [p[1] for _, p in timings[1:]]
    result: dict[str, Any] = {
        "model": name,
        "backend": args.backend,
        "quantize": quantize,
        "threads": torch.get_num_threads(),
        "image": f"{SIDE}x{SIDE}",
        "runs": reps,
        "prompt_tokens": ours.prompt_tokens,
        "peer_prompt_tokens": theirs.prompt_tokens,
        "encode_ms": median(encode),
        "ttft_ms": median(ttft),
        "peer": "transformers " + __import__("transformers").__version__,
        "peer_encode_ms": median(peer_encode),
        "peer_ttft_ms": median(peer_ttft),
    }
    result["ratio_vs_peer"] = {
        "encode": round(result["peer_encode_ms"] / result["encode_ms"], 2),
        "ttft": round(result["peer_ttft_ms"] / result["ttft_ms"], 2),
    }
    return result
