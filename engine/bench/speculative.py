"""`bench speculative`: decode speed with speculative decoding ÷ without, greedy, on three chat tasks — editing a
~60-line code file the prompt contains, answering by quoting a pasted ~1,500-token document, open chat — and the
same with a draft model: replies of up to REPLY_TOKENS tokens. Headline `tasks` -> {name: {speedup, same_tokens,
acceptance}}.

Per task, each repeat runs the prompt twice on fresh memories of the product's geometry (no prefix cache): plain,
then with speculation (prompt lookup, adaptive K); `speedup` is the median over repeats of tokens/s (decode,
after the first token) with ÷ without, `same_tokens` the share of repeats whose greedy tokens were identical, and
`acceptance` the share of drafted tokens accepted (with `accepted_per_forward`, tokens per decode forward, and
`verify_decode_steps`, what a verify of each width it tried cost in decode steps, as the controller measured it).

`sampled_tasks`: the same three tasks at the model's own sampling defaults (what the app and `generate` use unless
told otherwise), each repeat with its own seed for both replies; the replies differ, so no `same_tokens`.
`verify_pays`: whether `auto` (the app's and `generate`'s default) speculates on this backend
(engine.generation.speculative `resolve`); the figures are prompt lookup's either way.

`draft`: the model held in fp32 (its GGUF blocks dequantized: `--quantize none`) drafted for by the same model as
stored (the GGUF's Q4_1), on the code-editing task: the same figures.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from engine.backends import open_backend
from engine.backends.base import Backend
from engine.generation.loop import GenerationSettings, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.generation.speculative import Controller, DraftModel, PromptLookup, Speculation, Speculator
from engine.loading.model_files import display_name, resolve_model_path
from engine.loading.sampling_defaults import model_sampling
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import Memory
from engine.session.setup import memory_factory_for

CODE = """import json
import os
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int

    def total(self) -> float:
        return self.price * self.quantity


def load_items(path: str) -> list[Item]:
    with open(path) as f:
        data = json.load(f)
    items = []
    for entry in data:
        items.append(Item(entry["name"], entry["price"], entry["quantity"]))
    return items


def save_items(path: str, items: list[Item]) -> None:
    data = [{"name": i.name, "price": i.price, "quantity": i.quantity} for i in items]
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def cheapest(items: list[Item]) -> Item:
    best = items[0]
    for item in items[1:]:
        if item.price < best.price:
            best = item
    return best


def grand_total(items: list[Item]) -> float:
    total = 0.0
    for item in items:
        total += item.total()
    return total


def report(items: list[Item]) -> str:
    lines = []
    for item in items:
        lines.append(f"{item.name}: {item.quantity} x {item.price:.2f}")
    lines.append(f"total: {grand_total(items):.2f}")
    return "\\n".join(lines)


def main() -> None:
    path = os.environ.get("ITEMS", "items.json")
    items = load_items(path)
    print(report(items))
    print("cheapest:", cheapest(items).name)


if __name__ == "__main__":
    main()
"""

TOPICS = (
    ("harbour", "the harbour", "fishing boats", "the old stone pier", "storms in the winter of 1887"),
    ("mill", "the paper mill", "river water", "the wooden wheel", "a fire in the spring of 1902"),
    ("school", "the village school", "forty children", "the bell tower", "a new roof in 1921"),
    ("railway", "the railway station", "the morning train", "the iron bridge", "floods in the autumn of 1934"),
    ("market", "the Saturday market", "farmers from the valley", "the covered hall", "a long drought in 1947"),
    ("library", "the public library", "two thousand books", "the reading room", "a gift from a sailor in 1956"),
    ("church", "the church of Saint Anne", "the choir", "the painted windows", "repairs after the war"),
    ("lighthouse", "the lighthouse", "ships at night", "the great lamp", "the last keeper leaving in 1979"),
    ("bakery", "the bakery on the square", "fresh bread", "the brick oven", "three generations of one family"),
    ("park", "the town park", "old oak trees", "the bandstand", "summer concerts since 1965"),
    ("museum", "the small museum", "maps and letters", "the glass cases", "volunteers who open it on Sundays"),
    ("hospital", "the cottage hospital", "twelve beds", "the garden ward", "a doctor who served for forty years"),
)


def document() -> str:
    """A ~1,500-token history of a made-up town, one paragraph per place."""
    paragraphs = [
        f"The story of {place} begins long ago. For many years, {place} was known for {what}, and people came from "
        f"far away to see {feature}. Older residents still remember {event}, which changed {place} for good. "
        f"Today, {place} is looked after by the town council, and visitors can read about {feature} on a small sign "
        f"by the entrance. Many families in Westbrook have a story about {place}, and the local newspaper often "
        f"prints letters about {what} and {feature}. The council plans to keep {place} open for the next generation."
        for _, place, what, feature, event in TOPICS
    ]
    return "A short history of Westbrook\n\n" + "\n\n".join(paragraphs)


# Up to this many tokens a reply: the whole edited file, the quoted paragraph and a short story fit; a reply cut
# shorter would leave out most of what the first two tasks ask for.
REPLY_TOKENS = 256

TASKS: dict[str, str] = {
    "code_edit": f"Here is a Python file:\n\n```python\n{CODE}```\n\nRename the function grand_total to sum_total "
    "everywhere and print the whole updated file.",
    # Asked for one paragraph verbatim, the default model copies the document at length (greedy): what this measures.
    "quote": f"{document()}\n\nRepeat the paragraph about the lighthouse word for word.",
    "open_chat": "Tell me a short story about a fox who learns to play the violin.",
}


GREEDY = SamplingSettings(greedy=True)


def run_once(
    backend: Backend,
    memory: Memory,
    tok: Tokenizer,
    prompt: str,
    max_tokens: int,
    sampling: SamplingSettings,
    speculator: Speculator | None,
) -> tuple[list[int], float]:
    """The tokens and decode tokens/s of one reply."""
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    mode = Speculation.OFF if speculator is None else Speculation.LOOKUP  # the speculator's drafter runs
    settings = GenerationSettings(max_tokens=max_tokens, sampling=sampling, speculative=mode)
    events = list(stream_generate(backend, memory, tok, ids, settings, speculator=speculator))
    return [e.token for e in events if e.token is not None], events[-1].tokens_per_s


def compare(
    backend: Backend,
    new_memory: Callable[[], Memory],
    tok: Tokenizer,
    prompt: str,
    max_tokens: int,
    repeats: int,
    speculator: Callable[[], Speculator],
    sampling: Callable[[int], SamplingSettings] = lambda repeat: GREEDY,
) -> dict[str, Any]:
    """`sampling(repeat)`: the settings both of a repeat's replies use."""
    ratios, same, drafted, accepted, forwards, tokens = [], 0, 0, 0, 0, 0
    steps: dict[int, list[float]] = {}
    for repeat in range(repeats):
        settings = sampling(repeat)
        plain, plain_rate = run_once(backend, new_memory(), tok, prompt, max_tokens, settings, None)
        spec = speculator()
        fast, fast_rate = run_once(backend, new_memory(), tok, prompt, max_tokens, settings, spec)
        ratios.append(fast_rate / plain_rate if plain_rate else 0.0)
        same += fast == plain
        c = spec.controller
        decode_s = c.decode_s
        if decode_s:
            for width, seconds in c.verify_s.items():
                steps.setdefault(width, []).append(seconds / decode_s)
        drafted, accepted, forwards, tokens = (
            drafted + c.drafted,
            accepted + c.accepted,
            forwards + c.forwards,
            tokens + max(len(fast) - 1, 0),
        )
    return {
        "speedup": round(statistics.median(ratios), 3),
        "same_tokens": same / repeats,
        "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
        "accepted_per_forward": round(tokens / forwards, 3) if forwards else 0.0,
        "drafted": drafted,
        "speedups": [round(r, 3) for r in ratios],
        # what a verify of each width the controller tried cost, in decode steps (its running figures, medians)
        "verify_decode_steps": {w: round(statistics.median(v), 2) for w, v in sorted(steps.items())},
        "generated_tokens": len(fast),
    }


def new_lookup() -> Speculator:
    return Speculator(PromptLookup(), Controller())


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model_path(args.model)
    repeats = 1 if args.quick else 3
    max_tokens = 32 if args.quick else REPLY_TOKENS
    tok = Tokenizer.load(model)
    factory = memory_factory_for(model, prefix_cache=False)
    backend = open_backend(model, args.backend, args.quantize).backend
    tasks = {
        name: compare(backend, lambda: factory(backend), tok, prompt, max_tokens, repeats, new_lookup)
        for name, prompt in TASKS.items()
    }
    defaults = model_sampling(model)
    sampled = {
        name: compare(
            backend,
            lambda: factory(backend),
            tok,
            prompt,
            max_tokens,
            repeats,
            new_lookup,
            lambda repeat: SamplingSettings.from_model(defaults, seed=repeat),
        )
        for name, prompt in TASKS.items()
    }
    for figures in sampled.values():
        del figures["same_tokens"]  # sampled replies with and without speculation draw different numbers
    target = open_backend(model, args.backend, "none").backend  # the same weights in fp32
    drafter_backend = backend.fork()
    draft = compare(
        target,
        lambda: factory(target),
        tok,
        TASKS["code_edit"],
        max_tokens,
        repeats,
        lambda: Speculator(DraftModel(drafter_backend, GREEDY), Controller()),
    )
    return {
        "model": display_name(model),
        "backend": backend.name,
        "quantize": backend.quantize,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "verify_pays": backend.verify_pays,
        "tasks": tasks,
        "sampling": asdict(SamplingSettings.from_model(defaults)),
        "sampled_tasks": sampled,
        "draft": {"target_quantize": target.quantize, "draft_quantize": backend.quantize, "code_edit": draft},
    }
