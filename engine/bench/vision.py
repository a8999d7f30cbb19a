"""`bench vision`: what a question about a picture costs, beside a peer on the same weights in the same run.

- `encode_ms`: the vision encoder (SigLIP, then SmolVLM's pixel shuffle and connector or Gemma 3's pooling and
  projector) over one 896x896 picture's frames (after the processor's tiling: for SmolVLM, 4 x 4 tiles and the
  global view; Gemma 3 takes one frame), on the backend that runs the model (a model held in blocks on the CPU, as
  beside llama.cpp: the native kernels' block products, engine.backends.vision_tower);
- `ttft_ms`: a chat question about that picture, from the request to its first token: decoding the picture,
  preprocessing, encoding and reading the prompt (no prefix cache, a picture not seen before);
- `ratio_vs_peer`: the peer's time ÷ ours for each (above 1: we are faster), with `peer_encode_ms`,
  `peer_ttft_ms` and `peer` (llama.cpp's mtmd on a GGUF + mmproj of the same folder where `--peer-python` names an
  interpreter with llama-cpp-python; else transformers: its processor, the folder's model in fp32, one forward for
  the first token).

The peer is llama.cpp's mtmd (llama-cpp-python) where it can run: `--peer-python` names an interpreter that has
llama_cpp built (else this one, when it imports llama_cpp); it runs in a process of its own
(engine/bench/vision_peer.py) on a GGUF of the text model and an mmproj of the encoder written here from the same
folder, in the block format we hold (Q8_0 unless `--quantize` names another: the very bytes our load quantizes to,
both quantizers being ggml's reference one). Otherwise the peer is transformers' Idefics3 (fp32, its processor, one forward for the first
token) and we run fp32 too. Each figure is the median over fresh pictures (the encoder's output is kept per picture,
so a picture seen before would cost nothing), the two engines alternating picture by picture. Without `--model` the
folder is random weights at SmolVLM-256M-Instruct's shapes written by transformers (`write_smolvlm_shapes`; weights
do not change speed, and nothing is downloaded).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from engine.bench.checkpoints import byte_level_vocabulary
from engine.bench.gguf_export import export_gguf
from engine.bench.llamacpp_peer import peer_environment
from engine.bench.mmproj_export import export_mmproj
from engine.errors import SparkError
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.model_files import display_name, resolve_model_path
from engine.process import user_omp_wait_policy
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
NEWLINE = "\u010a"  # "\n" as a byte-level vocabulary spells it
NEWLINES = NEWLINE * 2
IDEFICS3_TOKENS += ["<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]


def write_smolvlm_shapes(out: Path, seed: int = 0) -> Path:
    """A SmolVLM-256M-Instruct-shaped folder (SigLIP-B/16 at 512 px, pixel shuffle by 4, SmolLM2-135M's text model,
    its processor's sizes) with random weights and a byte-level vocabulary, written by transformers."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab_size = 49280
    vocab, merges = byte_level_vocabulary(vocab_size - len(IDEFICS3_TOKENS) + 1)  # its <|endoftext|> is ours
    # "\n\n" as one token, as SmolLM2's vocabulary has it: llama.cpp's mtmd looks it up to open the global view.
    left, right = merges.pop()
    vocab[NEWLINES] = vocab.pop(left + right)
    merges.append((NEWLINE, NEWLINE))
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


class Peer(Protocol):
    name: str
    version: str
    prompt_tokens: int

    def ask(self, data: bytes) -> tuple[float, float]:
        """(encode ms, ttft ms) for a question about the picture `data`."""
        ...


def question_prompt(folder: Path) -> str:
    """The question about one picture through the folder's chat template, `<image>` where the picture goes (the
    processor's own rendering: what both engines read)."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt: str = processor.apply_chat_template(messages, add_generation_prompt=True)
    return prompt


class TransformersPeer:
    """transformers' model of the same folder (Idefics3, Gemma 3): its processor and one forward for the first
    token."""

    name = "transformers"

    def __init__(self, folder: Path) -> None:
        import transformers

        self.version = transformers.__version__
        arch = json.loads((folder / "config.json").read_text(encoding="utf-8"))["architectures"][0]
        model_class = getattr(transformers, arch)
        self.model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
        self.processor = transformers.AutoProcessor.from_pretrained(folder)
        first, last = PEER_ENCODERS[arch]
        self.watch = Stopwatch(getattr(self.model.model, first), getattr(self.model.model, last))
        self.prompt = question_prompt(folder)
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


class MtmdPeer:
    """llama.cpp's mtmd on a GGUF + mmproj, in a process of its own run by `python` (engine/bench/vision_peer.py),
    driven a picture at a time."""

    name = "llama.cpp mtmd"

    def __init__(self, python: str, text: Path, mmproj: Path, prompt: str, threads: int, work: Path) -> None:
        script = Path(__file__).with_name("vision_peer.py")
        command = [python, str(script), "--model", str(text), "--mmproj", str(mmproj), "--prompt", prompt]
        command += ["--threads", str(threads)]
        self.proc = subprocess.Popen(  # OpenMP's wait policy as the user had it (llamacpp_peer says why)
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=peer_environment(user_omp_wait_policy()),
            text=True,
        )
        self.work = work
        self.asked = 0
        try:
            self.version = str(self._reply().get("llama_cpp", "?"))
        except SparkError:
            self.close()
            raise
        self.prompt_tokens = 0

    def _reply(self) -> dict[str, Any]:
        """The peer's next JSON object; lines that are none (llama.cpp's backtrace when it aborts) are skipped."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            if isinstance(reply, dict):
                if "error" in reply:
                    raise SparkError(f"The llama.cpp mtmd peer failed: {reply['error']}.")
                return reply
        try:
            code: int | None = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited (code {code})"
        raise SparkError(f"The llama.cpp mtmd peer {how}.")

    def ask(self, data: bytes) -> tuple[float, float]:
        assert self.proc.stdin is not None
        path = self.work / f"picture-{self.asked}.png"
        self.asked += 1
        path.write_bytes(data)
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        reply = self._reply()
        self.prompt_tokens = int(reply["prompt_tokens"])
        return float(reply["encode_ms"]), float(reply["ttft_ms"])

    def close(self) -> None:
        """End the peer: its input closed, it exits; one that does not within 30 s is killed."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def peer_python(args: argparse.Namespace) -> str | None:
    """The interpreter that runs llama.cpp's mtmd: `--peer-python`, else this one where it imports llama_cpp."""
    named = getattr(args, "peer_python", None)
    if named:
        return str(named)
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


def median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import transformers  # noqa: F401  (the random folder's writer, the prompt's rendering, the fallback peer)
    except ImportError:
        raise SparkError("bench vision needs transformers; install the bench extra.") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = 1 if args.quick else 3
    pictures = [noise_picture(seed) for seed in range(reps + 1)]  # the first warms both engines up
    python = peer_python(args)
    with tempfile.TemporaryDirectory(prefix="spark-bench-vision-") as tmp:
        if args.model is None:
            folder, name = write_smolvlm_shapes(Path(tmp) / "smolvlm"), "random weights, SmolVLM-256M-Instruct shapes"
        else:
            folder = resolve_model_path(args.model)
            name = display_name(folder)
            if not is_vision_folder(folder):
                raise SparkError(f"{name} is not a vision model folder this engine runs (SmolVLM, Gemma 3).")
        if python is None:  # transformers runs fp32: so do we
            quantize = "none" if args.quantize == "auto" else args.quantize
            theirs: Peer = TransformersPeer(folder)
        else:  # llama.cpp runs the blocks we hold, from a file of the same bytes
            quantize = "q8_0" if args.quantize in ("auto", "none") else args.quantize
            text = export_gguf(folder, Path(tmp) / "text.gguf", quantize)
            mmproj = export_mmproj(folder, Path(tmp) / "mmproj.gguf", "q8_0")
            threads = args.threads or torch.get_num_threads()
            theirs = MtmdPeer(python, text, mmproj, question_prompt(folder), threads, Path(tmp))
        ours = Ours(load(folder, args.backend, quantize=quantize, prefix_cache=False))
        try:
            # Alternated picture by picture, so a machine whose load drifts weighs on both alike; the first warms up.
            timings = [(ours.ask(data), theirs.ask(data)) for data in pictures]
        finally:
            if isinstance(theirs, MtmdPeer):
                theirs.close()
    assert ours.engine.vision is not None
    encode = [o[0] for o, _ in timings[1:]]
    ttft = [o[1] for o, _ in timings[1:]]
    peer_encode = [p[0] for _, p in timings[1:]]
    peer_ttft = [p[1] for _, p in timings[1:]]
    result: dict[str, Any] = {
        "model": name,
        "backend": args.backend,
        "quantize": quantize,
        "encoder": ours.engine.vision.placement,
        "threads": torch.get_num_threads(),
        "image": f"{SIDE}x{SIDE}",
        "runs": reps,
        "prompt_tokens": ours.prompt_tokens,
        "peer_prompt_tokens": theirs.prompt_tokens,
        "encode_ms": median(encode),
        "ttft_ms": median(ttft),
        "peer": theirs.name,
        "peer_version": theirs.version,
        "peer_encode_ms": median(peer_encode),
        "peer_ttft_ms": median(peer_ttft),
    }
    result["ratio_vs_peer"] = {
        "encode": round(result["peer_encode_ms"] / result["encode_ms"], 2),
        "ttft": round(result["peer_ttft_ms"] / result["ttft_ms"], 2),
    }
    return result
