"""Training loop for the bundled model: deterministic, resumable, time-budgeted, CPU or CUDA.

Determinism: the batch of step `s` is drawn from `numpy.random.default_rng([seed, s])` and the learning rate is a
function of `s` and the total, so with a fixed `--steps N` a run resumed from a checkpoint replays exactly the
steps an uninterrupted run would have taken (bit-identical on the same device and thread count).

Schedule: linear warmup by step, then cosine decay to `min_lr_ratio` over `progress`, which goes from 0 to 1
(see `advance_progress`); the first `short_fraction` of progress trains at `short_seq_len` (cheaper attention,
more steps in the same time), the rest at `seq_len` (1024 for the bundled model, so every position the cascade
uses — sinks + retrieval blocks + window = 772 — was trained). Both phases see the same tokens per step.
`--steps N` fixes the total. With `--minutes` the total is planned from a timed forward+backward at each sequence
length and re-planned every 10 steps from measured step times, so the schedule ends at the deadline even on a
shared machine whose speed changes; re-planning changes only the pace of the progress still to come, so the
learning rate never rises again and the context never shrinks back. Such a run depends on the machine's speed:
it is reproducible in recipe, not bit for bit. FINAL_RESERVE_S of the budget is kept for the final held-out
eval, the export and the samples; if the budget still runs out first, the run saves and exports what it has.

A checkpoint is written every `checkpoint_every_s` and when SIGTERM/SIGINT arrives (after the current step);
`--resume` continues from it with the recipe stored in it.
Checkpoints are safetensors (weights, AdamW moments) + JSON (step, plan, history); never pickle.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from engine.config import ModelConfig
from engine.errors import SparkError
from engine.model import Transformer
from engine.train.bpe import BOS, END, EOS, chat_text, save_tokenizer, train_bpe
from engine.train.corpus import build_corpus

CASCADE_DEFAULTS: dict[str, Any] = {"sink_tokens": 4, "window": 512, "block_size": 64, "retrieval_blocks": 4, "routing": "hybrid"}
# Kept free at the end of a --minutes budget for the full held-out eval, the export and the samples (CPU).
FINAL_RESERVE_S = 300.0
SAMPLE_PROMPTS: list[tuple[str, bool]] = [  # (text, as a chat question)
    ("class ", False),
    ("json.dumps(obj", False),
    ("    Return the ", False),
    ("What does os.path.join do?", True),
]


class TrainError(SparkError):
    """Training cannot start or continue."""


@dataclass
class TrainConfig:
    out: Path
    export: Path | None = None  # the HF model folder written at the end; default OUT/model
    minutes: float = 65.0
    steps: int | None = None  # fixed total steps; None plans from --minutes
    device: str = "cpu"
    threads: int = 2
    seed: int = 1234
    # model
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 688
    # data / schedule
    seq_len: int = 1024
    short_seq_len: int = 256
    short_fraction: float = 0.6
    batch_tokens: int = 4096
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # reporting
    log_every_s: float = 30.0
    checkpoint_every_s: float = 300.0
    eval_every_s: float = 900.0
    eval_windows: int = 16  # periodic eval; the final eval uses every held-out window
    modules: list[str] | None = None  # stdlib modules to build the corpus from (tests); None = all

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"], d["export"] = str(self.out), (str(self.export) if self.export else None)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in known})
        cfg.out = Path(cfg.out)
        cfg.export = Path(cfg.export) if cfg.export else None
        return cfg


def log(msg: str) -> None:
    print(msg, flush=True)


def fmt_time(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# ---------------------------------------------------------------- data


@dataclass
class Data:
    tokenizer: Tokenizer
    train: np.ndarray  # (N,) uint16 token stream, documents joined as BOS doc EOS
    eval: np.ndarray  # (M,) held-out modules, same format
    manifest: dict[str, Any]


def prepare_data(cfg: TrainConfig) -> Data:
    """Build corpus + tokenizer + token streams once into OUT/data (reused on resume; deterministic anyway)."""
    data_dir = cfg.out / "data"
    manifest_path = data_dir / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if manifest.get("vocab_size") == cfg.vocab_size and manifest.get("modules") == cfg.modules:
            return Data(
                Tokenizer.from_file(str(data_dir / "tokenizer.json")),
                np.load(data_dir / "train.npy", allow_pickle=False),
                np.load(data_dir / "eval.npy", allow_pickle=False),
                manifest,
            )
    t0 = time.monotonic()
    corpus = build_corpus(cfg.modules)
    train_texts = [corpus.train_pages[k] for k in sorted(corpus.train_pages)] + [chat_text(q, a) for q, a in corpus.train_chats]
    tok = train_bpe(train_texts, cfg.vocab_size)
    if tok.get_vocab_size() > 65535:
        raise TrainError("The vocabulary is larger than 65535 tokens, which this trainer's uint16 token streams cannot hold.")
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)

    def stream(texts: list[str]) -> np.ndarray:
        ids: list[int] = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids.append(bos)
            ids.extend(enc.ids)
            ids.append(eos)
        return np.asarray(ids, dtype=np.uint16)

    train = stream(train_texts)
    held = stream([corpus.eval_pages[k] for k in sorted(corpus.eval_pages)])
    manifest = {
        "vocab_size": cfg.vocab_size,
        "modules": cfg.modules,
        "corpus_digest": corpus.digest(),
        "train_pages": len(corpus.train_pages),
        "train_chats": len(corpus.train_chats),
        "eval_modules": corpus.eval_modules,
        "eval_pages": len(corpus.eval_pages),
        "train_tokens": int(train.size),
        "eval_tokens": int(held.size),
    }
    tmp = data_dir.with_name("data.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_tokenizer(tok, tmp, cfg.seq_len)
    np.save(tmp / "train.npy", train, allow_pickle=False)
    np.save(tmp / "eval.npy", held, allow_pickle=False)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    shutil.rmtree(data_dir, ignore_errors=True)
    tmp.rename(data_dir)
    log(
        f"corpus: {manifest['train_pages']} pages + {manifest['train_chats']} chat examples -> {train.size:,} train tokens; "
        f"held out {len(corpus.eval_modules)} modules ({manifest['eval_pages']} pages, {held.size:,} tokens); "
        f"digest {manifest['corpus_digest']} ({time.monotonic() - t0:.0f}s)"
    )
    return Data(tok, train, held, manifest)


def batch_at(stream: np.ndarray, seed: int, step: int, batch: int, seq: int) -> torch.Tensor:
    """(batch, seq + 1) random windows of the stream; a pure function of (seed, step), which makes resume exact."""
    if stream.size < seq + 2:
        raise TrainError(f"The training corpus has {stream.size} tokens, fewer than one sequence of {seq + 1}.")
    starts = np.random.default_rng([seed, step]).integers(0, stream.size - seq - 1, size=batch)
    rows = np.stack([stream[s : s + seq + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


# ---------------------------------------------------------------- model


def hf_config(cfg: TrainConfig, tok: Tokenizer, dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.hidden_size // cfg.num_heads,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(END)],
        "torch_dtype": dtype,
        "use_cache": True,
    }


def build_model(cfg: TrainConfig, tok: Tokenizer, device: torch.device) -> Transformer:
    """Fresh model, initialised like Llama/GPT-2: N(0, 0.02), residual outputs scaled by 1/sqrt(2L) so the
    residual stream's variance does not grow with depth."""
    torch.manual_seed(cfg.seed)
    model = Transformer(ModelConfig.from_dict(hf_config(cfg, tok, "float32")))
    resid_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            torch.nn.init.ones_(p)  # RMSNorm gains
        else:
            torch.nn.init.normal_(p, 0.0, resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02)
    return model.to(device)


def param_count(model: Transformer) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def make_optimizer(model: Transformer, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices (incl. the tied embedding), never the RMSNorm gains.
    named = list(model.named_parameters())
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup by step, then cosine over `progress` (0 -> 1), which never decreases, so neither does 1 - lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def seq_len_at(cfg: TrainConfig, progress: float) -> int:
    return cfg.short_seq_len if progress < cfg.short_fraction else cfg.seq_len


def advance_progress(cfg: TrainConfig, step: int, progress: float, total: int) -> float:
    """Progress after `step`: 0 through warmup, then the rest of the way to 1 split evenly over the steps left.

    With a fixed total this is (step + 1 - warmup) / (total - warmup); when a time-budgeted run re-plans its total,
    only the pace of what is left changes, so the learning rate keeps falling and the context never shrinks back.
    """
    if step + 1 <= cfg.warmup_steps:
        return 0.0
    return progress + (1.0 - progress) / max(1, total - step)


def loss_on(model: Transformer, rows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of rows (B, T+1)."""
    logits = model.forward_causal(rows[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))


def train_step(model: Transformer, opt: torch.optim.AdamW, cfg: TrainConfig, step: int, progress: float, stream: np.ndarray, device: torch.device) -> float:
    seq = seq_len_at(cfg, progress)
    rows = batch_at(stream, cfg.seed, step, max(1, cfg.batch_tokens // seq), seq).to(device)
    for group in opt.param_groups:
        group["lr"] = lr_at(cfg, step, progress)
    loss = loss_on(model, rows)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return float(loss.detach())


@torch.inference_mode()
def evaluate(model: Transformer, stream: np.ndarray, seq: int, max_windows: int | None, device: torch.device) -> tuple[float, int]:
    """Held-out perplexity over non-overlapping windows (evenly spaced when capped); returns (ppl, tokens scored)."""
    n = (stream.size - 1) // seq
    if n == 0:
        raise TrainError(f"The held-out split has {stream.size} tokens, fewer than one window of {seq + 1}.")
    picks = list(range(n)) if max_windows is None or max_windows >= n else [i * n // max_windows for i in range(max_windows)]
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(picks), 4):
        rows = torch.from_numpy(np.stack([stream[w * seq : w * seq + seq + 1] for w in picks[i : i + 4]]).astype(np.int64)).to(device)
        total += float(loss_on(model, rows)) * rows.shape[0] * seq
        count += rows.shape[0] * seq
    model.train()
    return math.exp(total / count), count


# ---------------------------------------------------------------- checkpoints


def save_checkpoint(model: Transformer, opt: torch.optim.AdamW, state: dict[str, Any], ckpt: Path) -> None:
    """Atomic: write a sibling folder, then swap it in, so a kill mid-save leaves the previous checkpoint intact."""
    tmp, old = ckpt.with_name(ckpt.name + ".tmp"), ckpt.with_name(ckpt.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names = {p: n for n, p in model.named_parameters()}
    save_file({n: p.detach().cpu().contiguous() for p, n in names.items()}, str(tmp / "model.safetensors"))
    moments: dict[str, torch.Tensor] = {}
    for p, n in names.items():
        st = opt.state.get(p)
        if st:
            moments[f"{n}::exp_avg"] = st["exp_avg"].detach().cpu().contiguous()
            moments[f"{n}::exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().contiguous()
            moments[f"{n}::step"] = st["step"].detach().cpu().reshape(1).contiguous()
    save_file(moments, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps(state, indent=2), encoding="utf-8")
    if ckpt.exists():
        shutil.rmtree(old, ignore_errors=True)
        ckpt.rename(old)
    tmp.rename(ckpt)
    shutil.rmtree(old, ignore_errors=True)


STATE_KEYS = frozenset({"step", "total_steps", "progress", "step_times", "step_ratio", "tokens_seen", "train_seconds", "history", "evals", "corpus_digest", "config"})


def recover_checkpoint(ckpt: Path) -> None:
    """A kill between the two renames of `save_checkpoint` leaves only checkpoint.old: put it back."""
    old = ckpt.with_name(ckpt.name + ".old")
    if not ckpt.exists() and (old / "state.json").is_file():
        old.rename(ckpt)


def load_checkpoint(model: Transformer, opt: torch.optim.AdamW, ckpt: Path, device: torch.device) -> dict[str, Any]:
    try:
        state = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise TrainError(f"The checkpoint state in {ckpt} is unreadable; start a new run in another --out.") from None
    if not isinstance(state, dict) or not STATE_KEYS <= state.keys():
        raise TrainError(f"The checkpoint in {ckpt} was written by another version of the trainer; start a new run in another --out.")
    weights = load_file(str(ckpt / "model.safetensors"))
    moments = load_file(str(ckpt / "optimizer.safetensors"))
    for n, p in model.named_parameters():
        if n not in weights:
            raise TrainError(f"The checkpoint in {ckpt} lacks {n}; it is from a different model configuration.")
        with torch.no_grad():
            p.copy_(weights[n].to(device))
        if f"{n}::exp_avg" in moments:
            opt.state[p] = {
                "step": moments[f"{n}::step"].reshape(()).clone(),
                "exp_avg": moments[f"{n}::exp_avg"].to(device),
                "exp_avg_sq": moments[f"{n}::exp_avg_sq"].to(device),
            }
    return state


# ---------------------------------------------------------------- export and samples


def export_model(model: Transformer, cfg: TrainConfig, data: Data, out: Path) -> None:
    """Write a Hugging Face folder (fp16 safetensors, tied lm_head omitted) that `engine.weights.load_model` reads."""
    out.mkdir(parents=True, exist_ok=True)
    state = {n: t.detach().to("cpu", torch.float16).contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    save_file(dict(sorted(state.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = data.tokenizer
    (out / "config.json").write_text(json.dumps(hf_config(cfg, tok, "float16"), indent=2) + "\n", encoding="utf-8")
    save_tokenizer(tok, out, cfg.seq_len)
    eos_ids = [tok.token_to_id(EOS), tok.token_to_id(END)]
    generation = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": eos_ids, "do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.9}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    (out / "cascade.json").write_text(json.dumps(CASCADE_DEFAULTS, indent=2) + "\n", encoding="utf-8")


@torch.inference_mode()
def sample(model: Transformer, tok: Tokenizer, prompt: str, chat: bool, max_new: int = 80, top_k: int = 40, temperature: float = 0.7, seed: int = 0) -> str:
    """Minimal top-k sampler over the cache-free causal path (quality check only; the app uses engine.generate)."""
    text = f"{BOS}<|user|>\n{prompt}{END}\n<|assistant|>\n" if chat else f"{BOS}{prompt}"
    ids = tok.encode(text, add_special_tokens=False).ids
    stops = {tok.token_to_id(EOS), tok.token_to_id(END)}
    gen = torch.Generator().manual_seed(seed)
    device = model.lm_head.weight.device
    out: list[int] = []
    model.eval()
    for _ in range(max_new):
        ctx = (ids + out)[-model.config.max_position_embeddings :]
        logits = model.forward_causal(torch.tensor([ctx], device=device))[0, -1].float().cpu() / temperature  # (V,)
        vals, idx = logits.topk(top_k)
        nxt = int(idx[torch.multinomial(vals.softmax(-1), 1, generator=gen)])
        if nxt in stops:
            break
        out.append(nxt)
    model.train()
    return tok.decode(out, skip_special_tokens=False)


# ---------------------------------------------------------------- the run


def measure_step_times(model: Transformer, cfg: TrainConfig, data: Data, device: torch.device) -> dict[str, float]:
    """Seconds per step at each sequence length, from a timed forward+backward (no update, gradients dropped)."""

    def step_time(seq: int) -> float:
        rows = batch_at(data.train, cfg.seed, 0, max(1, cfg.batch_tokens // seq), seq).to(device)
        times = []
        for _ in range(3):  # the first run pays allocation and kernel selection
            t0 = time.perf_counter()
            loss_on(model, rows).backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        return min(times[1:]) * 1.15  # + optimizer step and ordinary jitter

    return {str(cfg.short_seq_len): step_time(cfg.short_seq_len), str(cfg.seq_len): step_time(cfg.seq_len)}


def fit_total_steps(cfg: TrainConfig, step: int, progress: float, seconds: float, step_times: dict[str, float]) -> int:
    """Largest total T such that steps step..T-1 (warmup and short phase first, then long) fit in `seconds`."""
    t_short, t_long = step_times[str(cfg.short_seq_len)], step_times[str(cfg.seq_len)]

    def cost(total: int) -> float:
        warm = max(0, cfg.warmup_steps - step)
        rest = max(0, total - step - warm)
        # Progress moves (1 - progress) / rest per step after warmup, so this many steps stay below the boundary.
        short = min(rest, math.ceil(max(0.0, cfg.short_fraction - progress) * rest / max(1e-12, 1.0 - progress)))
        return (warm + short) * (t_short if cfg.short_fraction > 0 else t_long) + (rest - short) * t_long

    lo, hi = step + 1, step + 2
    while cost(hi) <= seconds:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid) <= seconds else (lo, mid)
    return max(lo, cfg.warmup_steps + 1)


def new_state(cfg: TrainConfig, data: Data, total: int, step_times: dict[str, float]) -> dict[str, Any]:
    """The JSON half of a checkpoint at step 0 (the run's progress, plan and recipe)."""
    ratio = step_times[str(cfg.seq_len)] / step_times[str(cfg.short_seq_len)] if step_times else 1.0
    return {
        "step": 0,
        "total_steps": total,
        "progress": 0.0,
        "step_times": step_times,
        "step_ratio": ratio,
        "tokens_seen": 0,
        "train_seconds": 0.0,
        "history": [],
        "evals": [],
        "corpus_digest": data.manifest["corpus_digest"],
        "seed": cfg.seed,
        "config": cfg.to_json(),
    }


def run(cfg: TrainConfig, resume: bool = False) -> dict[str, Any]:
    """Train (or resume) in cfg.out, export the model, and return the summary (also written to OUT/summary.json)."""
    started = time.monotonic()
    deadline = started + cfg.minutes * 60
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda was requested but PyTorch sees no CUDA GPU on this machine.")
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    ckpt = cfg.out / "checkpoint"
    recover_checkpoint(ckpt)
    if resume:
        if not (ckpt / "state.json").is_file():
            raise TrainError(f"There is no checkpoint in {cfg.out} to resume; start without --resume.")
        saved = TrainConfig.from_json(json.loads((ckpt / "state.json").read_text(encoding="utf-8"))["config"])
        # The recipe comes from the checkpoint; only this invocation's budget, device and output may change.
        saved.minutes, saved.device, saved.threads, saved.out = cfg.minutes, cfg.device, cfg.threads, cfg.out
        saved.export = cfg.export or saved.export
        cfg = saved
    elif (ckpt / "state.json").is_file():
        raise TrainError(f"{cfg.out} already holds a checkpoint; pass --resume to continue it or choose another --out.")
    cfg.out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(cfg)
    model = build_model(cfg, data.tokenizer, device)
    model.train()
    opt = make_optimizer(model, cfg)
    log(f"model: {param_count(model):,} parameters, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {data.tokenizer.get_vocab_size()}, device {device}")

    if resume:
        state = load_checkpoint(model, opt, ckpt, device)
        if state["corpus_digest"] != data.manifest["corpus_digest"]:
            raise TrainError("The rebuilt corpus differs from the one this checkpoint was trained on (another Python version?).")
        log(f"resumed at step {state['step']}/{state['total_steps']}")
    else:
        step_times = {} if cfg.steps else measure_step_times(model, cfg, data, device)
        total = cfg.steps or fit_total_steps(cfg, 0, 0.0, deadline - time.monotonic() - FINAL_RESERVE_S, step_times)
        if step_times:
            log(f"plan: {', '.join(f'{v:.2f}s/step at seq {k}' for k, v in step_times.items())} -> {total} steps in {cfg.minutes:g} minutes")
        state = new_state(cfg, data, total, step_times)

    if resume and cfg.steps is None:
        state["total_steps"] = fit_total_steps(cfg, state["step"], state["progress"], deadline - time.monotonic() - FINAL_RESERVE_S, state["step_times"])
        log(f"re-planned for this budget: {state['total_steps']} steps")
    stop = {"signal": None}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["signal"] = signum  # finish the current step, save, exit cleanly

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    total = state["total_steps"]
    last_log = last_ckpt = last_eval = time.monotonic()
    window_tokens, window_t0 = 0, time.monotonic()
    losses: list[float] = []
    try:
        while state["step"] < total and stop["signal"] is None:
            if cfg.steps is None and time.monotonic() > deadline - FINAL_RESERVE_S:
                log(f"time budget reached at step {state['step']}/{total}; saving (run again with --resume to finish the schedule)")
                break
            t0 = time.monotonic()
            seq, lr = seq_len_at(cfg, state["progress"]), lr_at(cfg, state["step"], state["progress"])
            losses.append(train_step(model, opt, cfg, state["step"], state["progress"], data.train, device))
            state["progress"] = advance_progress(cfg, state["step"], state["progress"], total)
            state["step"] += 1
            n_tok = max(1, cfg.batch_tokens // seq) * seq
            state["tokens_seen"] += n_tok
            window_tokens += n_tok
            now = time.monotonic()
            state["train_seconds"] += now - t0
            if cfg.steps is None:
                # A shared machine speeds up and slows down: track step time per length and re-plan the total so
                # the cosine ends at the deadline (a fixed --steps schedule never changes, and is bit-reproducible).
                times = state["step_times"]
                times[str(seq)] = 0.9 * times[str(seq)] + 0.1 * (now - t0)
                if state["step"] % 10 == 0:
                    other = str(cfg.seq_len if seq == cfg.short_seq_len else cfg.short_seq_len)
                    if seq == cfg.short_seq_len:  # keep the measured long/short cost ratio for the phase not yet seen
                        times[other] = times[str(seq)] * state["step_ratio"]
                    total = state["total_steps"] = fit_total_steps(cfg, state["step"], state["progress"], deadline - now - FINAL_RESERVE_S, times)
            if now - last_log >= cfg.log_every_s or state["step"] == total:
                rate = window_tokens / max(1e-9, now - window_t0)
                left = (total - state["step"]) * (now - window_t0) / max(1, len(losses))
                mean = sum(losses) / len(losses)
                state["history"].append({"step": state["step"], "loss": round(mean, 4), "tokens_per_s": round(rate)})
                log(
                    f"step {state['step']}/{total} seq {seq} loss {mean:.3f} lr {lr:.2e} "
                    f"{rate:,.0f} tok/s tokens {state['tokens_seen']:,} elapsed {fmt_time(now - started)} eta {fmt_time(left)}"
                )
                losses, window_tokens, window_t0, last_log = [], 0, now, now
            if now - last_eval >= cfg.eval_every_s:
                ppl, _ = evaluate(model, data.eval, cfg.seq_len, cfg.eval_windows, device)
                state["evals"].append({"step": state["step"], "ppl": round(ppl, 3), "windows": cfg.eval_windows})
                log(f"eval step {state['step']}: held-out ppl {ppl:.2f} ({cfg.eval_windows} windows of {cfg.seq_len})")
                last_eval = time.monotonic()
            if now - last_ckpt >= cfg.checkpoint_every_s:
                save_checkpoint(model, opt, state, ckpt)
                last_ckpt = time.monotonic()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    save_checkpoint(model, opt, state, ckpt)
    if stop["signal"] is not None:
        log(f"stopped by signal at step {state['step']}/{total}; checkpoint saved, continue with --resume")
        return {"step": state["step"], "total_steps": total, "stopped": True}

    ppl, scored = evaluate(model, data.eval, cfg.seq_len, None, device)
    export = cfg.export or cfg.out / "model"
    export_model(model, cfg, data, export)
    samples = [{"prompt": p, "chat": c, "text": sample(model, data.tokenizer, p, c, seed=cfg.seed)} for p, c in SAMPLE_PROMPTS]
    summary = {
        "parameters": param_count(model),
        "step": state["step"],
        "total_steps": total,
        "finished_schedule": state["step"] >= total,
        "tokens_seen": state["tokens_seen"],
        "train_tokens": data.manifest["train_tokens"],
        "epochs": round(state["tokens_seen"] / data.manifest["train_tokens"], 3),
        "train_seconds": round(state["train_seconds"], 1),
        "final_loss": state["history"][-1]["loss"] if state["history"] else None,
        "heldout_ppl": round(ppl, 3),
        "heldout_tokens": scored,
        "heldout_modules": data.manifest["eval_modules"],
        "corpus_digest": data.manifest["corpus_digest"],
        "device": str(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "export": str(export),
        "samples": samples,
        "config": cfg.to_json(),
    }
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    log(f"held-out ppl {ppl:.2f} over {scored:,} tokens; exported to {export}")
    for s in samples:
        log(f"--- sample ({'chat' if s['chat'] else 'completion'}) {s['prompt']!r}\n{s['text']}")
    log(f"done in {fmt_time(time.monotonic() - started)}")
    return summary
