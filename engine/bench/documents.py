"""`bench documents`: questions about attached documents (engine.documents) against full attention and truncation.

The corpus: DOCUMENTS generated text files (the passkey bench's filler, engine.bench.passkey) of about
`tokens / DOCUMENTS` tokens each, every one with FACTS_PER_DOCUMENT facts ("The pass key of the red harbour is
48213. ...") planted at known depths. Each question asks for one fact as raw text ("What is the pass key of the red
harbour? The pass key of the red harbour is") and is right when the greedy answer holds the key; each is also
asked in other words (PARAPHRASE: "Which number opens the harbour painted red? ..."), sharing only the name with
the fact, so the figure is not only a template matching itself.

- `accuracy`: a conversation with every document attached (capsules in a fresh persistent store), reset between
  questions (attachments stay);
- `accuracy_full_attention`: the whole corpus then the question, under full attention, where that fits the
  model's trained context; else null;
- `accuracy_truncated`: what a peer does with a corpus too long for it: the corpus's last trained-context's worth
  (less the question and answer) then the question, under full attention;
- `second_question_ttft_ratio`: the first question's time to first token (reading every document included) over a
  second question's in another conversation attaching the same documents (found on disk);
- `disk_bytes_per_token`: what the capsules take in the persistent store per document token;
- `accuracy_paraphrased` (and `accuracy_paraphrased_full_attention`): the same facts asked in other words.

`--tokens N` sets the corpus's size (default TOKENS, `--quick` QUICK_TOKENS): 8x the default model's trained
context is `--tokens 65536`. `--cache-dir DIR` keeps the capsules in DIR and reuses them on later runs (to iterate
on retrieval without reading ~75k tokens again); the first question then reads nothing, so
`second_question_ttft_ratio` is only meaningful on a fresh folder (the default).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.bench.passkey import FILLER
from engine.documents.attach import Attachments
from engine.documents.extract import extract
from engine.errors import SparkError
from engine.generation.loop import GenerationSettings, decode_step, prefill
from engine.generation.sampling import SamplingSettings
from engine.loading.model_files import resolve_model_path
from engine.memory.base import FullAttentionMemory
from engine.session.engine import Engine, Session, memory_factory_for

DOCUMENTS = 4
FACTS_PER_DOCUMENT = 3
TOKENS = 32_000
QUICK_TOKENS = 6_000
MIN_TOKENS, MAX_TOKENS = 1_000, 1_000_000  # --tokens: room for the facts, and within what attaching allows
ANSWER_TOKENS = 6
COLOURS = ("red", "blue", "green", "silver", "amber", "violet", "black", "white", "golden", "grey", "orange", "pink")
PLACES = ("harbour", "library", "tower", "garden", "bridge", "market", "mill", "chapel", "station", "farm", "gate")
FACT = "The pass key of the {name} is {key}. Remember it. {key} is the pass key of the {name}. "
QUESTION = "\nWhat is the pass key of the {name}? The pass key of the {name} is"
PARAPHRASE = "\nWhich number opens the {place} painted {colour}? The number that opens the {place} painted {colour} is"
CHUNK = 256


def corpus(tokens: int, seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str, float]]]:
    """(file name, text) per document and (name, key, depth) per fact; about `tokens` tokens in all (the filler
    is ~22 tokens a sentence group on the default model's tokenizer)."""
    rng = random.Random(seed)
    names = [f"{c} {p}" for c in COLOURS for p in PLACES]
    rng.shuffle(names)
    groups = max(FACTS_PER_DOCUMENT + 1, tokens // DOCUMENTS // 22)
    docs, facts = [], []
    for d in range(DOCUMENTS):
        lines = [FILLER] * groups
        for f in range(FACTS_PER_DOCUMENT):
            depth = (f + 0.5) / FACTS_PER_DOCUMENT
            name, key = names[d * FACTS_PER_DOCUMENT + f], str(rng.randrange(10000, 100000))
            lines.insert(round(depth * groups) + f, FACT.format(name=name, key=key))
            facts.append((name, key, depth))
        docs.append((f"notes-{d + 1}.txt", "\n".join(lines)))
    return docs, facts


def greedy(backend: Any, memory: Any, tok: Any, ids: list[int]) -> str:
    logits = prefill(backend, memory, ids, CHUNK)
    assert logits is not None
    out: list[int] = []
    for _ in range(ANSWER_TOKENS):
        out.append(int(logits.argmax()))
        logits = decode_step(backend, memory, out[-1])
    return str(tok.decode(out))


def question(name: str, paraphrased: bool) -> str:
    if not paraphrased:
        return QUESTION.format(name=name)
    colour, place = name.split(" ", 1)
    return PARAPHRASE.format(colour=colour, place=place)


def full_attention(
    engine: Engine, context: list[int], facts: list[tuple[str, str, float]], paraphrased: bool = False
) -> float:
    """The context read once under full attention; each question after it, taken back before the next."""
    tok = engine.tokenizer
    backend = engine.backend.fork()
    questions = [tok.encode(question(n, paraphrased), add_bos=False) for n, _, _ in facts]
    backend.allocate(1, len(context) + max(map(len, questions)) + ANSWER_TOKENS)
    memory = FullAttentionMemory(backend)
    prefill(backend, memory, context, CHUNK)
    right = 0
    for (_, key, _), q in zip(facts, questions, strict=True):
        got = greedy(backend, memory, tok, q)
        right += key in got
        del memory.tokens[len(context) :]  # FullAttentionMemory: slot i holds token i; the next plan overwrites
    return right / len(facts)


def ask(session: Session, attachments: Attachments, name: str, paraphrased: bool = False) -> tuple[str, float]:
    """The answer to one question in `session` (reset first) and its time to first token."""
    session.reset()
    settings = GenerationSettings(max_tokens=ANSWER_TOKENS, sampling=SamplingSettings(greedy=True))
    t0 = time.perf_counter()
    first = 0.0
    text = []
    for ev in session.complete(FILLER + question(name, paraphrased), settings):
        if not first:
            first = time.perf_counter() - t0
            attachments.observe()
        text.append(ev.text)
    return "".join(text), first


def run(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    tokens = getattr(args, "tokens", None) or (QUICK_TOKENS if getattr(args, "quick", False) else TOKENS)
    if not MIN_TOKENS <= tokens <= MAX_TOKENS:
        raise SparkError(f"--tokens must be between {MIN_TOKENS:,} and {MAX_TOKENS:,}.")
    model = resolve_model_path(args.model)
    docs, facts = corpus(tokens)
    kept = getattr(args, "cache_dir", None)  # capsules reused across runs: nothing is read again (iterating)
    with (
        contextlib.nullcontext(str(kept))
        if kept
        else tempfile.TemporaryDirectory(prefix="spark-bench-documents-") as cache
    ):
        factory = memory_factory_for(model, cache_dir=Path(cache))
        engine = Engine.load(model, args.backend or "cpu", memory_factory=factory, quantize=args.quantize)
        tok = engine.tokenizer
        trained = engine.backend.config.max_position_embeddings
        session = engine.new_session()
        attachments = Attachments(session.memory, tok)
        t0 = time.perf_counter()
        for name, text in docs:
            attachments.attach_document(extract(name, text.encode()))
        read_s = time.perf_counter() - t0
        trials: list[dict[str, Any]] = []
        for i, (name, key, depth) in enumerate(facts):
            got, ttft = ask(session, attachments, name)
            if i == 0:
                ttft += read_s
            cited = [c.label() for c in attachments.recalled]
            trials.append({"name": name, "key": key, "depth": depth, "answer": got, "ok": key in got,
                           "ttft_s": round(ttft, 3), "recalled": cited})  # fmt: skip
        reworded: list[dict[str, Any]] = []
        for name, key, depth in facts:
            got, _ = ask(session, attachments, name, paraphrased=True)
            cited = [c.label() for c in attachments.recalled]
            reworded.append({"name": name, "key": key, "depth": depth, "answer": got, "ok": key in got,
                             "recalled": cited})  # fmt: skip
        second = engine.new_session()  # another conversation: its capsules are found on disk
        t1 = time.perf_counter()
        again = Attachments(second.memory, tok)
        for name, text in docs:
            again.attach_document(extract(name, text.encode()))
        attach_again_s = time.perf_counter() - t1
        _, ttft2 = ask(second, again, facts[1][0])
        ttft2 += attach_again_s
        doc_tokens = attachments.document_tokens
        disk = sum(a.capsule.disk_bytes for a in attachments.items)
        corpus_ids = tok.encode("\n".join(text for _, text in docs))
        room = trained - 64 - ANSWER_TOKENS
        fits = len(corpus_ids) <= room
        full = full_attention(engine, corpus_ids, facts) if fits else None
        full_reworded = full_attention(engine, corpus_ids, facts, paraphrased=True) if fits else None
        truncated = full_attention(engine, corpus_ids[-room:], facts)
    return {
        "accuracy": sum(t["ok"] for t in trials) / len(trials),
        "accuracy_full_attention": full,
        "accuracy_truncated": truncated,
        "second_question_ttft_ratio": round(trials[0]["ttft_s"] / ttft2, 2) if ttft2 else None,
        "disk_bytes_per_token": round(disk / doc_tokens, 1),
        "accuracy_paraphrased": sum(t["ok"] for t in reworded) / len(reworded),
        "accuracy_paraphrased_full_attention": full_reworded,
        "document_tokens": doc_tokens,
        "corpus_vs_trained_context": round(len(corpus_ids) / trained, 2),
        "first_question_ttft_s": trials[0]["ttft_s"],
        "second_question_ttft_s": round(ttft2, 3),
        "read_tokens_per_s": round(attachments.read_tokens / read_s, 1),
        "model": str(model),
        "numerics": engine.backend.numerics,
        "trials": trials,
        "paraphrased_trials": reworded,
    }
