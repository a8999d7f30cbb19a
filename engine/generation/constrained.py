"""Constrained decoding: a grammar (JSON Schema, Lark, GBNF) turned into a mask over the vocabulary per step.

The grammar logic is llguidance's (MIT; Rust with abi3 wheels for macOS arm64 and Linux, no dependencies): its
Earley parser over a derivative-based lexer computes, for the tokens generated so far, which next tokens keep the
output inside the grammar. It was picked over xgrammar by measurement on the default model's 49,152-token
vocabulary: xgrammar's mask was faster per token (about 0.01 ms against 0.12 ms, both far below a decode step)
but compiled a first JSON schema in 1.5 s against llguidance's 6 ms, needs torch, transformers, triton and
apache-tvm-ffi at run time, and has no resource limits of its own; llguidance bounds every compilation and every
step with fuel (`LIMITS`), so a hostile grammar is refused instead of hanging the server.

Per reply a `TokenMask` follows the sampled tokens. The mask for the next step is computed on a worker thread
right after a token is accepted (llguidance drops the GIL), i.e. while the generation loop runs that token's
forward; `apply` waits for it only if it is not ready yet. JSON is generated compactly (", " and ": " between
items, no other whitespace), so a small model cannot pad a reply with whitespace until max_tokens: a schema whose
strings, arrays and numbers have bounds closes within a bounded number of tokens.

Shapes: V vocabulary (logits may have more rows than the tokenizer has ids; those are masked), W = ceil(V / 32)
words of the bit mask.
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
import torch

from engine.errors import SparkError
from engine.loading.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar text larger than this is refused before it is compiled
MAX_SCHEMA_DEPTH = 48  # nesting of objects/arrays in a JSON schema (the compiler recurses over it)

# Resource bounds on compilation and on every mask step (llguidance's defaults are sized for servers with big
# grammars; these keep the worst case of a hostile grammar to tens of milliseconds and a few MB).
LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=50_000,
    max_grammar_size=200_000,
    verbose_errors=False,
)

# Compact JSON: no free whitespace anywhere (the bound on a reply's length the module docstring promises).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(SparkError, ValueError):
    """A schema or grammar that cannot be used (malformed, unsupported, or beyond the resource bounds)."""


class GrammarKind(StrEnum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"  # any JSON object
    LARK = "lark"
    GBNF = "gbnf"


@dataclass(frozen=True)
class Grammar:
    """A validated grammar in llguidance's form, ready for a `TokenMask`."""

    kind: GrammarKind
    source: str  # llguidance's grammar text (what LLMatcher takes)


def _schema_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, walked without recursion (a hostile value may be deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v)
    return deepest


_SCALAR_TYPES = {"string", "number", "integer", "boolean", "null"}
_FINITE_PASSES = 64  # a ref chain resolves one link per pass at worst; a schema needing more is not refused here


def _subschemas(node: dict[str, Any]) -> list[Any]:
    """The schemas directly inside `node` (the keywords a compiler descends into)."""
    out: list[Any] = []
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        v = node.get(key)
        if isinstance(v, dict):
            out.extend(v.values())
    for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
        v = node.get(key)
        if isinstance(v, list):
            out.extend(v)
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
        if key in node:
            out.append(node[key])
    return out


def _resolve(root: Any, ref: Any) -> Any:
    """The schema a local `$ref` ("#", "#/$defs/a", any JSON pointer into the document) names, or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _has_finite_instance(root: Any) -> bool:
    """Whether some finite JSON value can match `root`, as far as `$ref` cycles decide it: a least fixpoint over
    the schema's nodes, where a node is finite when it admits a scalar, a constant, an object whose required
    properties are all finite, or an array whose required items are. A cycle every instance must walk round (a
    required property that `$ref`s its own schema) is never finite; the rest (ranges, patterns, allOf clashes) is the
    compiler's to judge."""
    nodes: list[dict[str, Any]] = []
    stack, seen = [root], set()
    while stack:
        v = stack.pop()
        if isinstance(v, dict) and id(v) not in seen:
            seen.add(id(v))
            nodes.append(v)
            stack.extend(_subschemas(v))
    finite: set[int] = set()

    def ok(v: Any) -> bool:
        if isinstance(v, bool):
            return v
        return (isinstance(v, dict) and id(v) in finite) or not isinstance(v, dict)

    def node_ok(n: dict[str, Any]) -> bool:
        if "$ref" in n:
            target = _resolve(root, n["$ref"])
            if target is not None and not ok(target):
                return False
        if isinstance(n.get("allOf"), list) and not all(ok(x) for x in n["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(n.get(key), list) and n[key] and not any(ok(x) for x in n[key]):
                return False
        if "const" in n or "enum" in n:
            return True
        kind = n.get("type")
        kinds = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()
        if not kinds:
            if any(k in n for k in ("properties", "required", "additionalProperties")):
                kinds = {"object"}
            elif any(k in n for k in ("items", "prefixItems", "minItems")):
                kinds = {"array"}
            else:
                return True
        if kinds & _SCALAR_TYPES or not kinds <= {*_SCALAR_TYPES, "object", "array"}:
            return True  # a scalar ends it; an unknown type is the compiler's to name
        if "object" in kinds and _object_ok(n, ok):
            return True
        return "array" in kinds and _array_ok(n, ok)

    for _ in range(_FINITE_PASSES):
        changed = False
        for n in reversed(nodes):  # children before parents: one pass settles everything but ref chains
            if id(n) not in finite and node_ok(n):
                finite.add(id(n))
                changed = True
        if not changed:
            return ok(root)
    return True


def _object_ok(n: dict[str, Any], ok: Any) -> bool:
    props: dict[str, Any] = n["properties"] if isinstance(n.get("properties"), dict) else {}
    extra = n.get("additionalProperties", True)
    required: list[Any] = n["required"] if isinstance(n.get("required"), list) else []
    return all(ok(props.get(r, extra)) for r in required if isinstance(r, str))


def _array_ok(n: dict[str, Any], ok: Any) -> bool:
    least = n.get("minItems", 0)
    least = least if isinstance(least, int) and not isinstance(least, bool) else 0
    if least <= 0:
        return True
    prefix: list[Any] = n["prefixItems"] if isinstance(n.get("prefixItems"), list) else []
    items = n.get("items", True)
    return all(ok(prefix[i] if i < len(prefix) else items) for i in range(min(least, len(prefix) + 1)))


def check_schema(schema: Any, what: str = "JSON schema") -> str:
    """A parsed JSON schema checked before it is compiled: an object (or a boolean), plain JSON, at most
    MAX_GRAMMAR_CHARS as text and MAX_SCHEMA_DEPTH deep, and with some finite instance (a `$ref` cycle through
    required properties has none: a reply could never close). Returns the schema as JSON text; raises GrammarError."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError(f"The {what} must be a JSON object.")
    if _schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"The {what} nests deeper than {MAX_SCHEMA_DEPTH} levels; flatten it.")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError):
        raise GrammarError(f"The {what} is not plain JSON.") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"The {what} is larger than {MAX_GRAMMAR_CHARS:,} characters; simplify it.")
    if not _has_finite_instance(schema):
        raise GrammarError(
            f"The {what} cannot be satisfied: it requires itself without end (a $ref cycle through required "
            "properties or items), so no finite JSON matches it."
        )
    return text


def _validated(kind: GrammarKind, source: str, what: str) -> Grammar:
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, None, limits=LIMITS)
    if failed:
        detail = (messages[0] if messages else "unknown error").strip().splitlines()[0].rstrip(".")
        raise GrammarError(f"The {what} cannot be used for constrained output: {detail[:300]}.")
    return Grammar(kind, source)


def json_schema_grammar(schema: Any, what: str = "JSON schema") -> Grammar:
    """A grammar for JSON matching `schema` (a parsed JSON Schema object)."""
    text = check_schema(schema, what)
    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"The {what} cannot be read: {str(exc)[:200]}.") from None
    return _validated(GrammarKind.JSON_SCHEMA, source, what)


_JSON_DIRECTIVE = re.compile(r"%json\s*")


def _embedded_json(text: str, start: int) -> tuple[int, int]:
    """The end of the JSON value starting at `text[start]` and its nesting depth, found by counting brackets
    outside strings (no parser recursion: the value may be built to be deep). End is len(text) if it never closes."""
    depth = deepest = 0
    i, n = start, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i + 1, deepest
        i += 1
    return n, deepest


def check_lark_schemas(text: str, what: str) -> None:
    """Every `%json {...}` schema inside a Lark grammar gets the checks a schema given alone gets (depth first, so a
    deep one never reaches the parser or the compiler)."""
    for m in _JSON_DIRECTIVE.finditer(text):
        start = m.end()
        if start >= len(text) or text[start] not in "{[":
            continue
        end, depth = _embedded_json(text, start)
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"A %json schema in the {what} nests deeper than {MAX_SCHEMA_DEPTH} levels; flatten it.")
        try:
            schema = json.loads(text[start:end])
        except ValueError:
            continue  # not JSON: the grammar's compiler names the error
        check_schema(schema, f"%json schema in the {what}")


def json_object_grammar() -> Grammar:
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    return json_schema_grammar({"type": "object"})


def text_grammar(text: str, kind: GrammarKind, what: str = "grammar") -> Grammar:
    """A Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's), from its text."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"The {what} is larger than {MAX_GRAMMAR_CHARS:,} characters; simplify it.")
    if kind is GrammarKind.GBNF:
        try:
            text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
        except Exception as exc:  # the converter raises whatever its parser meets; all of it means "malformed"
            raise GrammarError(f"The GBNF {what} cannot be read: {str(exc)[:200]}.") from None
    elif kind is not GrammarKind.LARK:
        raise ValueError(f"not a text grammar kind: {kind}")
    check_lark_schemas(text, what)
    return _validated(kind, llguidance.LLMatcher.grammar_from_lark(text), what)


def grammar_from_file_text(text: str, what: str) -> Grammar:
    """A grammar file's text: GBNF when it uses GBNF's `::=`, Lark otherwise (llguidance's own rule)."""
    kind = GrammarKind.LARK if llguidance.gbnf_to_lark.is_lark_syntax(text) else GrammarKind.GBNF
    return text_grammar(text, kind, what)


# -- per reply -----------------------------------------------------------------------------------------------------

_vocab_lock = threading.Lock()
_vocabs: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
# One worker: masks are small jobs, and a second thread would only compete with the forward for the cores.
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spark-mask")


def token_vocab(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` (built once per tokenizer: about a second for a 49k vocabulary)."""
    with _vocab_lock:
        vocab = _vocabs.get(tokenizer)
        if vocab is None:
            vocab = llguidance.LLTokenizer(
                tokenizer.backend_json(), n_vocab=tokenizer.vocab_size, eos_token=sorted(tokenizer.eos_ids)
            )
            _vocabs[tokenizer] = vocab
        return vocab


@dataclass
class MaskStats:
    masks: int = 0  # masks computed
    compute_s: float = 0.0  # in llguidance (on the worker thread, overlapping the forward)
    wait_s: float = 0.0  # the sampling step waited for a mask not ready yet
    apply_s: float = 0.0  # unpacking the bits and masking the logits

    @property
    def ms_per_token(self) -> float:
        """Mask work per token: llguidance's computation plus applying it (whether or not it overlapped)."""
        return (self.compute_s + self.apply_s) / self.masks * 1e3 if self.masks else 0.0


class TokenMask:
    """Follows one reply's tokens through `grammar` and masks each step's logits to the tokens it allows."""

    def __init__(self, grammar: Grammar, tokenizer: Tokenizer) -> None:
        vocab = token_vocab(tokenizer)
        self.vocab_size = vocab.vocab_size
        self.eos = sorted(tokenizer.eos_ids)
        self.matcher = llguidance.LLMatcher(vocab, grammar.source, log_level=0, limits=LIMITS)
        if self.matcher.is_error():
            raise GrammarError(f"The grammar cannot be used: {self.matcher.get_error()[:300]}.")
        self.bits = torch.full((-(-self.vocab_size // 32),), -1, dtype=torch.int32)  # (W,)
        self.bytes = self.bits.numpy().view(np.uint8)  # (W * 4,) the same memory, little-endian words
        # Per-step buffers, sized on the first `apply` (the logits' rows and dtype): no tensor is allocated per token
        # but the one row numpy's unpackbits returns.
        self.allowed = torch.zeros(0, dtype=torch.bool)  # (V',)
        self.out = torch.empty(0)  # (V',) the masked logits
        self.forbidden = torch.tensor(-torch.inf)  # () the value a forbidden token's logit gets
        self.stats = MaskStats()
        self.stopped = False
        self.pending: Future[None] | None = _executor.submit(self._fill)

    def _fill(self) -> None:
        t0 = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.bits.numel() * 4)
        self.stats.compute_s += time.perf_counter() - t0
        self.stats.masks += 1

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more: the reply ends here."""
        return self.stopped

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (V',) -> (V',) with every token the grammar forbids at -inf. A matcher in error (it should not
        happen: the sampled token was allowed) allows only EOS, so the reply ends instead of sampling from nothing.
        The result is this mask's own buffer, overwritten by the next `apply`."""
        if self.pending is not None:
            t0 = time.perf_counter()
            self.pending.result()
            self.pending = None
            self.stats.wait_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.out.shape != logits.shape or self.out.dtype != logits.dtype or self.out.device != logits.device:
            self.allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)  # rows past the vocabulary stay False
            self.out = torch.empty_like(logits)
            self.forbidden = torch.tensor(-torch.inf, dtype=logits.dtype, device=logits.device)
        allowed = self.allowed.numpy()
        if self.matcher.is_error():
            allowed[:] = False
            allowed[self.eos] = True
        else:
            n = min(self.vocab_size, logits.shape[-1])
            # bit i of word w: id 32w+i (words are little-endian)
            allowed[:n] = np.unpackbits(self.bytes, bitorder="little", count=n).view(np.bool_)
        torch.where(self.allowed.to(logits.device), logits, self.forbidden, out=self.out)
        self.stats.apply_s += time.perf_counter() - t0
        return self.out

    def advance(self, token: int) -> None:
        """Record the sampled `token` and start computing the next mask (on the worker, while the forward runs).
        The matcher is asked nothing while that runs (it is one object the worker borrows)."""
        self.matcher.consume_token(token)
        self.stopped = self.matcher.is_stopped()
        if not self.stopped and not self.matcher.is_error():
            self.pending = _executor.submit(self._fill)
