"""`python -m engine bench answers [--model M] [--json]` — are the replies right? Ours against llama.cpp on the same
GGUF, the same prompt token ids and the same sampler settings, over several seeds, in one run.

The questions (engine/heldout/answers.json, 40 of them: capitals, arithmetic, simple facts, unit conversions) go
through the model's chat template once; both engines sample from those ids until an end-of-reply token or
`MAX_TOKENS`, and a reply is acceptable when it contains an accepted answer as a whole word. Each engine samples
with its own sampler and seeded generator (llama.cpp applies temperature after its truncations, we before, as
transformers does), so the comparison is of answer quality at equal settings, not of equal tokens.

Two settings are measured: the model's own defaults (what the app answers with: `Engine.sampling_defaults`, from the
GGUF's sampling keys, generation_config.json or the catalog, with the loop guard for small models; the penalty window
is llama-cpp-python's fixed 64 tokens for both) and the app's old defaults (temperature 0.7, top-p off). Headlines:
`ratio_vs_llamacpp` (acceptable answers, ours ÷ theirs, at the model's defaults) and `gain_recommended_over_old`
(ours, the model's defaults ÷ the old defaults).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.bench.llamacpp_peer import LlamaCppPeer, PeerError, peer_environment
from engine.errors import SparkError
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.model_files import display_name, gguf_file_of, resolve_model_path
from engine.loading.sampling_defaults import ModelSampling
from engine.loading.tokenizer import Tokenizer
from engine.process import user_omp_wait_policy
from engine.session.engine import Session
from engine.session.engine import load as load_engine

QUESTIONS = Path(__file__).resolve().parent.parent / "heldout" / "answers.json"
MAX_TOKENS = 48
SEEDS = 8
QUICK_SEEDS = 2


@dataclass(frozen=True)
class Question:
    kind: str
    question: str
    accept: tuple[str, ...]


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repeat_penalty: float

    def ours(self, seed: int) -> SamplingSettings:
        return SamplingSettings(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repeat_penalty,
            repetition_window=64,  # llama-cpp-python's penalty window (last_n_tokens_size)
            seed=seed,
        )

    @classmethod
    def of_model(cls, m: ModelSampling) -> Sampling:
        temperature = 0.0 if m.greedy else m.temperature  # llama.cpp: temperature 0 is greedy
        return cls(temperature, m.top_p, m.top_k, m.min_p, m.repetition_penalty)


OLD_APP_DEFAULTS = Sampling(temperature=0.7, top_p=1.0, top_k=0, min_p=0.0, repeat_penalty=1.0)


def load_questions(path: Path = QUESTIONS) -> list[Question]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return [Question(q["kind"], q["question"], tuple(q["accept"])) for q in data["questions"]]


def _pattern(answer: str) -> re.Pattern[str]:
    # Short symbols (Au, CO2) must match as written; words and numbers in any case. Whole words only: 4 ≠ 42.
    flags = 0 if len(answer) <= 3 and any(c.isalpha() for c in answer) else re.IGNORECASE
    return re.compile(rf"(?<![\w]){re.escape(answer)}(?![\w])", flags)


def acceptable(reply: str, accept: Sequence[str]) -> bool:
    return any(_pattern(a).search(reply) for a in accept)


def prompt_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    """The ids both engines read: the chat template's text, with BOS added only where the template has none."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    bos = tokenizer.bos_id
    has_bos = bos is not None and rendered.startswith(tokenizer.decode([bos], skip_special=False))
    return tokenizer.encode(rendered, add_bos=not has_bos)


def ours_reply(session: Session, ids: list[int], sampling: Sampling, seed: int, eos: frozenset[int]) -> list[int]:
    session.reset()
    settings = GenerationSettings(max_tokens=MAX_TOKENS, sampling=sampling.ours(seed))
    return [e.token for e in session.complete_ids(ids, settings) if e.token is not None and e.token not in eos]


def _count(replies: dict[str, list[bool]]) -> dict[str, Any]:
    flat = [ok for oks in replies.values() for ok in oks]
    seeds = len(next(iter(replies.values()))) if replies else 0
    return {
        "acceptable": sum(flat),
        "replies": len(flat),
        "acceptable_per_40": round(40 * sum(flat) / max(len(flat), 1), 2),
        "questions_right_every_seed": sum(all(oks) for oks in replies.values()),
        "seeds": seeds,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    model = resolve_model_path(args.model)
    gguf = gguf_file_of(model)
    questions = load_questions()
    seeds = list(range(QUICK_SEEDS if args.quick else SEEDS))
    engine = load_engine(model, args.backend, quantize=args.quantize, prefix_cache=False)  # the app's cascade
    tokenizer = engine.tokenizer
    eos = tokenizer.eos_ids
    defaults = engine.sampling_defaults
    settings = {"recommended": Sampling.of_model(defaults), "old_app_defaults": OLD_APP_DEFAULTS}
    notes: list[str] = []
    result: dict[str, Any] = {
        "model": display_name(model),
        "backend": engine.choice.explain(),
        "threads": threads,
        "questions": len(questions),
        "seeds": len(seeds),
        "max_tokens": MAX_TOKENS,
        "settings": {name: asdict(s) for name, s in settings.items()},
        "recommended_source": defaults.described,
    }
    ids = {q.question: prompt_ids(tokenizer, q.question) for q in questions}

    session = engine.new_session()
    runs: dict[str, dict[str, dict[str, list[bool]]]] = {"ours": {}, "llamacpp": {}}
    samples: dict[str, dict[str, str]] = {"ours": {}, "llamacpp": {}}
    for name, sampling in settings.items():
        oks: dict[str, list[bool]] = {}
        for q in questions:
            replies = [tokenizer.decode(ours_reply(session, ids[q.question], sampling, seed, eos)) for seed in seeds]
            oks[q.question] = [acceptable(r, q.accept) for r in replies]
            if name == next(iter(settings)) and q is questions[0]:
                samples["ours"][name] = replies[0]
        runs["ours"][name] = oks

    peer: LlamaCppPeer | None = None
    if gguf is None:
        notes.append("llama.cpp was not measured: the model is not a GGUF file")
    elif importlib.util.find_spec("llama_cpp") is None:
        notes.append("llama-cpp-python is not installed (pip install -e '.[bench]'); llama.cpp was not measured")
    else:
        try:
            peer = LlamaCppPeer(peer_environment(user_omp_wait_policy()))
            longest = max(len(v) for v in ids.values())
            result["llamacpp_version"] = peer.load(gguf, n_ctx=longest + MAX_TOKENS + 8, threads=threads, n_batch=512)
            for name, sampling in settings.items():
                oks = {}
                for q in questions:
                    replies = [
                        tokenizer.decode(
                            peer.generate(ids[q.question], MAX_TOKENS, asdict(sampling), seed, sorted(eos))
                        )
                        for seed in seeds
                    ]
                    oks[q.question] = [acceptable(r, q.accept) for r in replies]
                    if name == next(iter(settings)) and q is questions[0]:
                        samples["llamacpp"][name] = replies[0]
                runs["llamacpp"][name] = oks
        except (SparkError, PeerError) as exc:
            notes.append(f"llama.cpp was not measured: {exc}")
            runs["llamacpp"] = {}
        finally:
            if peer is not None:
                peer.close()

    for engine_name, by_setting in runs.items():
        if by_setting:
            result[engine_name] = {name: _count(oks) for name, oks in by_setting.items()}
            result[engine_name]["by_kind"] = _by_kind(questions, by_setting[next(iter(by_setting))])
    ours, theirs = result.get("ours", {}), result.get("llamacpp", {})
    head = next(iter(settings))
    if theirs:
        result["ratio_vs_llamacpp"] = _ratio(ours[head]["acceptable"], theirs[head]["acceptable"])
        result["ratio_vs_llamacpp_old_defaults"] = _ratio(
            ours["old_app_defaults"]["acceptable"], theirs["old_app_defaults"]["acceptable"]
        )
    result["gain_recommended_over_old"] = _ratio(
        ours["recommended"]["acceptable"], ours["old_app_defaults"]["acceptable"]
    )
    if theirs:
        result["llamacpp_gain_recommended_over_old"] = _ratio(
            theirs["recommended"]["acceptable"], theirs["old_app_defaults"]["acceptable"]
        )
    result["first_question_first_seed"] = {"question": questions[0].question, **{k: v for k, v in samples.items() if v}}
    if notes:
        result["notes"] = notes
    return result


def _by_kind(questions: list[Question], oks: dict[str, list[bool]]) -> dict[str, str]:
    kinds: dict[str, list[bool]] = {}
    for q in questions:
        kinds.setdefault(q.kind, []).extend(oks[q.question])
    return {kind: f"{sum(v)}/{len(v)}" for kind, v in kinds.items()}


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 3) if b else None
