"""`bench reopen`: how long a conversation takes to come back with its memory — read back from the kept memory
(engine.session.kept) against recomputed from its compact record — for conversations of 4,000 and 32,000 tokens
(`--sizes`), on a switch (the same process, the model loaded) and in a new process (as after a relaunch).

Each conversation is one long user message (a plain English passage repeated to the size) and a short greedy reply,
stored compact as the app stores it, and its memory kept as the app keeps it. Then, per size:

- switch: in this process, a fresh session opens the record with the kept copy (`reopen_ms`) and without it
  (`recompute_ms`: the replay, with the persistent prefix cache off so nothing is borrowed);
- new_process: a fresh interpreter loads the model (not timed), opens the record with the kept copy (`reopen_ms`)
  and writes the first token of the continued reply (`first_token_ms`, from the start of the open);
- `same_tokens`: the reply continued from the kept copy equals the one continued from the conversation that never
  left memory and, where the replay was measured, the one continued from the replay, greedy;
- `paged_blocks`: the episodic blocks left in the kept file when it opened (read when retrieval first asks);
- `keep_ms`: what keeping the conversation costs the worker (`Session.keep(..., later=True)`: the snapshot; the
  writer thread does the rest), for the conversation built here and for it reopened from the kept copy after one
  more reply (its unchanged blocks are read by the writer, not copied by the worker).

`--recompute-sizes` names the sizes whose replay is measured (default: all): a 32,000-token replay takes as long as
building the conversation did.

The kept file was just written, so the new process reads it from the page cache, not a cold disk.
Headlines: `reopen_ms`, `recompute_ms` and `ratio` (recompute ÷ reopen), each per kind and size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.hw import this_machine_policy
from engine.loading.model_files import display_name, resolve_model_path
from engine.session.engine import Engine, Session, memory_factory_for
from engine.session.kept import KeptMemory

DEFAULT_SIZES = (4000, 32000)
PASSAGE = (
    "The harbour town woke early. Fishing boats went out before dawn, the baker opened at six, and the ferry to the "
    "islands left at half past seven, whatever the weather. Visitors came for the cliffs and the lighthouse, and "
    "stayed for the quiet evenings, when the only sounds were the gulls and the bell of the church on the hill. "
)
REPLY_TOKENS = 8
CONTINUE_TOKENS = 8
GREEDY = GenerationSettings(max_tokens=REPLY_TOKENS, sampling=SamplingSettings(greedy=True), ignore_eos=True)


def parse_sizes(text: str | None) -> list[int]:
    if not text:
        return list(DEFAULT_SIZES)
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sizes takes token counts separated by commas, not {text!r}") from None
    if not sizes or any(n < 64 or n > 1_000_000 for n in sizes):
        raise ValueError("--sizes takes token counts between 64 and 1,000,000")
    return sizes


def open_engine(model: Path, backend: str, cache: Path) -> Engine:
    # The app's geometry (the policy sizes the slot table), with no prefix cache: a recompute borrows nothing.
    policy = this_machine_policy()
    factory = memory_factory_for(model, cache_dir=cache, prefix_cache=False, policy=policy)
    return Engine.load(model, backend, memory_factory=factory, policy=policy)


def build(engine: Engine, tokens: int) -> Session:
    """A conversation of about `tokens` tokens: one long message and a short greedy reply."""
    per = len(engine.tokenizer.encode(PASSAGE, add_bos=False))
    text = PASSAGE * (tokens // per + 1)  # at least `tokens` with the template and the reply
    session = engine.new_session()
    for _ in session.chat(text, GREEDY):
        pass
    return session


def timed_open(session: Session, record: Path, kept: KeptMemory | None) -> float:
    t0 = time.perf_counter()
    session.load(record, kept=kept)
    return (time.perf_counter() - t0) * 1000


def continued(session: Session) -> list[int]:
    settings = GenerationSettings(max_tokens=CONTINUE_TOKENS, sampling=SamplingSettings(greedy=True), ignore_eos=True)
    return [e.token for e in session.continue_reply(settings) if e.token is not None]


def child(model: Path, backend: str, cache: Path, record: Path, kept_dir: Path) -> dict[str, Any]:
    """The new process: load the model, then time opening the record with its kept copy and the first token."""
    engine = open_engine(model, backend, cache)
    session = engine.new_session()
    t0 = time.perf_counter()
    session.load(record, kept=KeptMemory(kept_dir))
    reopen = time.perf_counter() - t0
    first = None
    settings = GenerationSettings(max_tokens=1, sampling=SamplingSettings(greedy=True), ignore_eos=True)
    for event in session.continue_reply(settings):
        if event.token is not None and first is None:
            first = time.perf_counter() - t0
    return {
        "reopen_ms": reopen * 1000,
        "first_token_ms": (first or 0.0) * 1000,
        "source": session.memory_source,
        "read_tokens": session.computed.count,
    }


def timed_keep(session: Session, kept: KeptMemory, record: Path) -> float:
    t0 = time.perf_counter()
    session.keep(kept, record, later=True)
    spent = (time.perf_counter() - t0) * 1000
    kept.flush()
    return spent


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model_path(args.model)
    backend = args.backend or "cpu"
    sizes = parse_sizes(getattr(args, "sizes", None))
    recompute_sizes = set(parse_sizes(getattr(args, "recompute_sizes", None) or ",".join(map(str, sizes))))
    result: dict[str, Any] = {
        "model": display_name(model),
        "backend": backend,
        "reopen_ms": {"switch": {}, "new_process": {}},
        "recompute_ms": {},
        "ratio": {"switch": {}, "new_process": {}},
        "first_token_ms": {},
        "tokens": {},
        "kept_bytes": {},
        "same_tokens": {},
        "paged_blocks": {},
        "keep_ms": {"built": {}, "reopened": {}},
    }
    with tempfile.TemporaryDirectory(prefix="bench-reopen-") as tmp:
        root = Path(tmp)
        engine = open_engine(model, backend, root / "l3")
        kept = KeptMemory(root / "kept")
        for size in sizes:
            key = str(size)
            record = root / f"c{size}.spark"
            session = build(engine, size)
            session.save(record, compact=True)
            result["keep_ms"]["built"][key] = round(timed_keep(session, kept, record), 1)
            result["tokens"][key] = len(session.memory.tokens)
            result["kept_bytes"][key] = kept.entry_path(record).stat().st_size
            from_kept = engine.new_session()
            reopen = timed_open(from_kept, record, kept)
            if from_kept.memory_source != "kept":
                return {**result, "error": f"the kept memory of the {size}-token conversation was not used"}
            blocks = from_kept.memory.episodic.blocks.values()  # type: ignore[attr-defined]
            result["paged_blocks"][key] = sum(b.paged is not None for b in blocks)
            never_left = continued(session)
            same = [continued(from_kept) == never_left]
            if size in recompute_sizes:
                replayed = engine.new_session()
                recompute = timed_open(replayed, record, None)
                same.append(continued(replayed) == never_left)
                del replayed
            result["same_tokens"][key] = all(same)
            if not result["same_tokens"][key]:
                return {**result, "error": f"the {size}-token conversation continued differently from the kept copy"}
            from_kept.save(record, compact=True)  # one more reply since it was reopened: keep it again
            result["keep_ms"]["reopened"][key] = round(timed_keep(from_kept, kept, record), 1)
            del session, from_kept
            cmd = [sys.executable, "-m", "engine.bench.reopen", str(model), backend, str(root / "l3"), str(record)]
            proc = subprocess.run([*cmd, str(root / "kept")], capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                return {**result, "error": f"the new process failed: {proc.stderr.strip().splitlines()[-1:]}"}
            fresh = json.loads(proc.stdout)
            if fresh["source"] != "kept" or fresh["read_tokens"] != 1:  # the pending token is the only one fed
                return {**result, "error": f"the new process did not read the kept memory back ({fresh})"}
            result["reopen_ms"]["switch"][key] = round(reopen, 1)
            result["reopen_ms"]["new_process"][key] = round(fresh["reopen_ms"], 1)
            result["first_token_ms"][key] = round(fresh["first_token_ms"], 1)
            if size in recompute_sizes:
                result["recompute_ms"][key] = round(recompute, 1)
                result["ratio"]["switch"][key] = round(recompute / reopen, 1)
                result["ratio"]["new_process"][key] = round(recompute / fresh["reopen_ms"], 1)
    return result


if __name__ == "__main__":  # the new process
    model_arg, backend_arg, cache_arg, record_arg, kept_arg = sys.argv[1:6]
    print(json.dumps(child(Path(model_arg), backend_arg, Path(cache_arg), Path(record_arg), Path(kept_arg))))
