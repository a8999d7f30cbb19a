"""`python -m engine generate` and the shared model/sampling arguments of the CLI (docs/DESIGN.md, "Command-line contract")."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from engine.backends import QUANTIZE_CHOICES
from engine.cli.checks import check_max_tokens, check_seed, check_text, check_threads, read_text_file
from engine.documents.attach import Attached, Attachments, Reattacher
from engine.errors import SparkError
from engine.generation.beam import MAX_BEAMS, BeamSettings, EarlyStopping, beams_summary
from engine.generation.constrained import MAX_GRAMMAR_CHARS, Grammar, grammar_from_file_text, json_schema_grammar
from engine.generation.loop import GenerationEvent, GenerationSettings
from engine.generation.reasoning import ReasoningStyle, Think, ThinkSwitch
from engine.generation.sampling import SamplingSettings
from engine.generation.speculative import MAX_DRAFT, Speculation
from engine.hw import this_machine_policy, use_recommended_threads
from engine.loading.model_files import resolve_model_path
from engine.loading.sampling_defaults import model_sampling
from engine.model.kv_types import KVType
from engine.paths import default_cache_dir
from engine.session.engine import Engine, Session, memory_factory_for
from engine.session.kept import KeptMemory
from engine.vision.images import DecodedImage, decode_file


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct, the installed default model)",
    )
    p.add_argument(
        "--mmproj",
        type=Path,
        default=None,
        help="a GGUF model's llama.cpp projector file, for pictures (default: the one mmproj*.gguf beside the model)",
    )
    p.add_argument("--backend", default="auto", choices=["auto", "coreml", "mlx", "mps", "cuda", "cpu"])
    p.add_argument("--cache-dir", type=Path, default=None, help="persistent (L3) prefix cache folder")
    p.add_argument("--no-prefix-cache", action="store_true", help="do not read or write the persistent prefix cache")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: performance cores, or all but one)")
    p.add_argument(
        "--quantize",
        default="auto",
        choices=QUANTIZE_CHOICES,
        help="weight storage (auto: a GGUF as stored, else q8_0 on the cpu backend; int8: Core ML)",
    )
    p.add_argument(
        "--kv-type",
        default="f16",
        choices=[t.value for t in KVType],
        help="what the slot table holds keys and values in (llama.cpp's --cache-type-k/v): q8_0 takes 53%% of f16",
    )


# The sampling flags; where one is not given, the model's own defaults (engine.loading.sampling_defaults) decide.
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
DEFAULT_MAX_TOKENS = 128


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    # None = not given: the model's own defaults decide (its GGUF keys, generation_config.json, the catalog).
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument(
        "--greedy",
        action="store_true",
        default=None,
        help="always take the most likely token: no repetition penalty either (the model's default one included) "
        "unless --repetition-penalty is given too; --temperature 0 means the same",
    )
    p.add_argument("--temperature", type=float, default=None, help="0: greedy (see --greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--speculative",
        default=Speculation.AUTO.value,
        choices=[m.value for m in Speculation],
        help="speculative decoding: auto (the default: prompt lookup for greedy replies where verifying is measured "
        "to pay, plain decoding otherwise), off, lookup (always), draft (needs --draft-model)",
    )
    p.add_argument(
        "--draft-tokens", type=int, default=0, help="drafts per verify forward (default 0: adapted to what pays)"
    )
    p.add_argument(
        "--draft-model", type=Path, default=None, help="a smaller model of the same vocabulary drafting tokens"
    )


def settings_from_args(args: argparse.Namespace, model_dir: Path) -> GenerationSettings:
    """Flags first, then the model's own sampling defaults (engine.loading.sampling_defaults)."""
    given = {k: getattr(args, k) for k in (*SAMPLING_FLAGS, "greedy") if getattr(args, k) is not None}
    if any(k in given for k in ("temperature", "top_p", "top_k", "min_p")) and "greedy" not in given:
        given["greedy"] = False  # asking for sampling parameters means sampling, whatever the model's default
    if (given.get("greedy") or given.get("temperature") == 0.0) and "repetition_penalty" not in given:
        # Greedy asked for means the argmax of the model's own logits (transformers' and llama.cpp's greedy): a
        # model's default penalty (the loop guard of small models) would change the tokens behind the user's back.
        given["repetition_penalty"] = 1.0
    model = model_sampling(model_dir)
    v = {**vars(model), "max_tokens": model.max_tokens or DEFAULT_MAX_TOKENS, **given}
    check_max_tokens(v["max_tokens"])
    check_seed(args.seed)
    for stop in args.stop:
        check_text(stop, "--stop")
    sampling = SamplingSettings(
        temperature=v["temperature"],
        top_k=v["top_k"],
        top_p=v["top_p"],
        min_p=v["min_p"],
        repetition_penalty=v["repetition_penalty"],
        repetition_window=v["repetition_window"],
        seed=args.seed,
        greedy=v["greedy"],
    )
    sampling.validate()
    speculative = Speculation(getattr(args, "speculative", Speculation.AUTO))
    if speculative is Speculation.DRAFT and getattr(args, "draft_model", None) is None:
        raise SparkError("--speculative draft needs --draft-model M (a smaller model of the same vocabulary).")
    draft_tokens = getattr(args, "draft_tokens", 0)
    if not 0 <= draft_tokens <= MAX_DRAFT:
        raise SparkError(f"--draft-tokens must be 0 (adaptive) to {MAX_DRAFT}, not {draft_tokens}.")
    return GenerationSettings(
        max_tokens=v["max_tokens"],
        stop=tuple(args.stop),
        sampling=sampling,
        speculative=speculative,
        draft_tokens=draft_tokens,
        beam=beam_from_args(args),
    )


def beam_from_args(args: argparse.Namespace) -> BeamSettings:
    """--beams N (every beam reported with --json), --length-penalty, --early-stopping; one beam without them."""
    beams = getattr(args, "beams", 1)
    if not 1 <= beams <= MAX_BEAMS:
        raise SparkError(f"--beams must be 1 to {MAX_BEAMS}, not {beams}.")
    penalty = getattr(args, "length_penalty", 0.0)
    if not -10.0 <= penalty <= 10.0:
        raise SparkError(f"--length-penalty must be between -10 and 10, not {penalty}.")
    early = EarlyStopping(getattr(args, "early_stopping", EarlyStopping.HEURISTIC))
    return BeamSettings(beams, penalty, early, returned=beams)


def open_engine(args: argparse.Namespace) -> Engine:
    check_threads(args.threads)
    use_recommended_threads(args.threads)
    policy = this_machine_policy()
    factory = memory_factory_for(
        args.model, cache_dir=args.cache_dir, prefix_cache=not args.no_prefix_cache, policy=policy
    )
    return Engine.load(
        args.model,
        args.backend,
        memory_factory=factory,
        policy=policy,
        quantize=args.quantize,
        draft_model=getattr(args, "draft_model", None),
        kv_type=KVType(args.kv_type),
        mmproj=getattr(args, "mmproj", None),
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt (raw completion, or --chat)")
    add_model_args(p)
    p.add_argument("--prompt", default=None, help="prompt text (raw completion unless --chat)")
    p.add_argument("--prompt-file", type=Path, default=None, help="read the prompt from a file")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument(
        "--think",
        default=Think.AUTO.value,
        choices=[t.value for t in Think],
        help="with --chat, for a model that reasons: think before answering (on), answer directly (off), or the "
        "model's default (auto). Its reasoning is printed on stderr, or under `reasoning` with --json",
    )
    p.add_argument(
        "--image",
        type=Path,
        action="append",
        default=[],
        help="a PNG, JPEG, WebP or GIF the prompt is about (repeatable; placed at the prompt's <image> markers, else "
        "before its text)",
    )
    add_sampling_args(p)
    p.add_argument(
        "--save-session", type=Path, default=None, help="save the conversation and its memory to a .spark file"
    )
    p.add_argument("--load-session", type=Path, default=None, help="continue a saved .spark conversation")
    p.add_argument(
        "--continue", dest="continue_", action="store_true", help="with --load-session: extend the last reply"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--beams", type=int, default=1, help="beam search over N beams (deterministic; default 1: off)")
    p.add_argument(
        "--length-penalty",
        type=float,
        default=0.0,
        help="beam scores: sum of logprobs / length ** this (default 0: the plain sum; transformers' default is 1)",
    )
    p.add_argument(
        "--early-stopping",
        default=EarlyStopping.HEURISTIC.value,
        choices=[e.value for e in EarlyStopping],
        help="when beam search stops once N beams finished (transformers' False, True, 'never')",
    )
    p.add_argument(
        "--attach",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a document (text, Markdown, code, HTML, PDF) the model may draw on, read once and kept (repeatable)",
    )
    p.add_argument(
        "--recall-session",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="an earlier conversation (.spark) the model may draw on, as an attached document (repeatable)",
    )
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", type=Path, default=None, help="reply with JSON matching this JSON Schema file")
    shape.add_argument("--grammar", type=Path, default=None, help="reply in this grammar (a Lark or GBNF file)")
    p.set_defaults(func=run)


def read_grammar(args: argparse.Namespace) -> Grammar | None:
    """The grammar of --json-schema or --grammar, checked before the model loads; None when neither is given."""
    if args.json_schema is not None:
        text = read_text_file(args.json_schema, "--json-schema", MAX_GRAMMAR_CHARS * 4)
        try:
            schema = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            raise SparkError(f"{args.json_schema} is not valid JSON; --json-schema needs a JSON Schema file.") from None
        return json_schema_grammar(schema, f"JSON schema in {args.json_schema}")
    if args.grammar is not None:
        text = read_text_file(args.grammar, "--grammar", MAX_GRAMMAR_CHARS * 4)
        return grammar_from_file_text(text, f"grammar in {args.grammar}")
    return None


def read_prompt(args: argparse.Namespace) -> str | None:
    if args.prompt_file is not None:
        return read_text_file(args.prompt_file, "--prompt-file")
    check_text(args.prompt, "--prompt")
    prompt: str | None = args.prompt
    return prompt


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    if args.continue_ and args.load_session is None:
        raise SparkError("--continue needs --load-session FILE (the conversation to continue).")
    if prompt is None and not args.continue_:
        raise SparkError("Give a prompt with --prompt TEXT (or --load-session FILE --continue).")
    if args.image and prompt is None:
        raise SparkError("--image needs a prompt (--prompt TEXT) to ask about the picture.")
    images = [decode_file(path) for path in args.image]  # a bad picture fails before any loading
    settings = settings_from_args(args, resolve_model_path(args.model))  # bad flags fail before any loading
    settings.grammar = read_grammar(args)
    settings.think = Think(args.think)
    if settings.think is not Think.AUTO and not args.chat:
        raise SparkError("--think applies to a chat turn; add --chat.")
    if settings.grammar is not None and settings.beam.beams > 1:
        raise SparkError("--beams does not combine with --json-schema or --grammar; give one or the other.")
    engine = open_engine(args)
    check_think(engine.reasoning, settings.think)
    session = engine.new_session()
    found = Reattacher()
    read_before = 0
    if args.load_session is not None:
        # Documents given with a conversation are read (or found) first: one it recorded is then in the store.
        pre = attach_all(session, args, notes=False)  # said once, by the attaching after the load
        read_before = pre.read_tokens if pre is not None else 0
        # A compact file the app kept the memory of reads it back instead of recomputing it (engine.session.kept).
        kept_dir = (args.cache_dir or default_cache_dir()) / "kept"
        kept = None if args.no_prefix_cache else KeptMemory(kept_dir)
        report = session.load(args.load_session, kept=kept, reattach=found)
        if report.foreign_model:
            print(f"note: {report.message}", file=sys.stderr)
    attachments = attach_all(session, args, found.found)
    events = pick_stream(session, prompt, args, settings, images)
    if attachments is not None:
        events = observing(events, attachments)
    if not args.json:
        print(f"backend: {engine.choice.explain()}", file=sys.stderr)
    text, reasoning, tokens, last = stream(events, echo=not args.json)
    if attachments is not None and not args.json:
        for c in attachments.recalled:
            print(f"recalled: {c.label()}", file=sys.stderr)
    if args.json:
        out = {
            "text": text,
            "reasoning": reasoning,  # the think block, apart from `text` ("" for a model that does not reason)
            "tokens": tokens,
            "prompt_tokens": last.prompt_tokens if last else 0,
            "ttft_s": last.ttft_s if last else 0.0,
            "tokens_per_s": last.tokens_per_s if last else 0.0,
            "backend": engine.backend.name,
            "backend_reason": engine.choice.explain(),
            "finish_reason": last.finish_reason if last else None,
            # every token the model computed in this run: replays and reading attachments too
            "read_tokens": session.computed.count
            + read_before
            + (attachments.read_tokens if attachments is not None else 0),
        }
        if attachments is not None:
            out["document_tokens"] = attachments.document_tokens
            out["recalled"] = [c.to_dict() for c in attachments.recalled]
        if last is not None and last.speculating and last.forwards:
            # Tokens per decode forward (the first token comes from the prompt's forward): 1.0 without gains.
            out["accepted_per_forward"] = round((last.generated_tokens - 1) / last.forwards, 3)
        if last is not None and last.beams:  # every beam, best first: its text, tokens, logprob and score
            out["beams"] = [
                {"text": engine.tokenizer.decode(list(h.tokens)), **b}
                for h, b in zip(last.beams, beams_summary(last.beams), strict=True)
            ]
        print(json.dumps(out, ensure_ascii=False), flush=True)
    if args.save_session is not None:  # after the reply is out: a failed save must not lose it
        try:
            session.save(args.save_session)
        except SparkError as exc:
            raise SparkError(f"The reply was printed but not saved: {exc}") from None
    return 0


def attach_all(
    session: Session, args: argparse.Namespace, restored: Sequence[Attached] = (), notes: bool = True
) -> Attachments | None:
    """--attach and --recall-session, in that order, each read once (a capsule already on disk reads nothing), beside
    what a loaded conversation holds (`restored`; a document it holds already is not attached twice)."""
    if not args.attach and not args.recall_session and not restored:
        return None
    attachments = Attachments(session.memory, session.tokenizer, session.attachments)
    attachments.restored(list(restored))
    for path in args.attach:
        attachments.attach_file(path, progress(path, args.json), once=True)
    for path in args.recall_session:
        attachments.recall_session(path, progress(path, args.json), once=True)
    for note in attachments.notes if notes else ():
        print(f"note: {note}", file=sys.stderr)
    return attachments


def progress(path: Path, quiet: bool) -> Callable[[int, int], None] | None:
    """Reading an attachment's progress on stderr (a terminal's line rewritten in place), unless `quiet`."""
    if quiet or not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        end = "\n" if done >= total else ""
        print(f"\rreading {path.name}: {done:,} of {total:,} tokens", end=end, file=sys.stderr, flush=True)

    return show


def observing(events: Iterable[GenerationEvent], attachments: Attachments) -> Iterator[GenerationEvent]:
    """The events as they come; at the first, what the prompt routed the reply to is recorded as recalled."""
    first = True
    for ev in events:
        if first:
            attachments.observe()
            first = False
        yield ev


def pick_stream(
    session: Session,
    prompt: str | None,
    args: argparse.Namespace,
    settings: GenerationSettings,
    images: Sequence[DecodedImage] = (),
) -> Iterator[GenerationEvent]:
    if prompt is None:
        return session.continue_reply(settings)
    if args.chat:
        return session.chat(prompt, settings, images=images)
    return session.complete(prompt, settings, images=images)


def check_think(style: ReasoningStyle, think: Think) -> None:
    """--think on/off where the model can do it, one sentence otherwise."""
    if think is Think.AUTO:
        return
    if not style.reasons:
        raise SparkError(f"--think {think.value}: this model does not reason (its chat template has no thinking).")
    if think is Think.OFF and style.switch is ThinkSwitch.NONE:
        raise SparkError("--think off: this model always thinks; its chat template has no switch.")


def stream(events: Iterable[GenerationEvent], echo: bool) -> tuple[str, str, list[int], GenerationEvent | None]:
    """(answer, reasoning, token ids, last event); with `echo` the answer goes to stdout as it comes and the
    reasoning to stderr."""
    text: list[str] = []
    reasoning: list[str] = []
    tokens: list[int] = []
    last: GenerationEvent | None = None
    for ev in events:
        if ev.token is not None:
            tokens.append(ev.token)
        text.append(ev.text)
        reasoning.append(ev.reasoning)
        if echo and ev.reasoning:
            sys.stderr.write(ev.reasoning)
            sys.stderr.flush()
        if echo and ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        last = ev
    if echo:
        sys.stdout.write("\n")
    return "".join(text), "".join(reasoning), tokens, last
