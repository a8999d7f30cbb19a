"""Tokenizer of a Hugging Face model folder or a GGUF file: encode/decode through HF `tokenizers`, chat templates, EOS ids,
and a streaming detokenizer that emits text as soon as it is final.

Only `tokenizer.json` is read for the vocabulary (a JSON file: nothing is ever unpickled). A folder with only a
SentencePiece `tokenizer.model` is refused with a sentence saying how to get a `tokenizer.json`.

Where transformers and this module could differ, the choice is documented on the method:
- BOS: an explicit `add_bos_token` / `add_eos_token` in tokenizer_config.json decides, otherwise the
  tokenizer.json post-processor does (transformers 4's LlamaTokenizerFast rule; transformers 5 ignores the
  config flags when a tokenizer.json exists, so the two agree whenever config and post-processor agree, as they
  do in released Llama/Mistral/Qwen folders). A BOS is never doubled.
- Decoding never applies `clean_up_tokenization_spaces`: transformers skips it for BPE tokenizers too, and every
  Llama-family tokenizer is BPE.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

from engine.errors import TokenizerError
from engine.loading.chat_template import render_chat
from engine.loading.gguf_tokenizer import tokenizer_parts
from engine.loading.model_files import gguf_model, is_gguf_model

# Special-token names transformers passes to chat templates (its `special_tokens_map`).
_TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# A run of this many tokens that never completes a UTF-8 character is garbage output; the stream emits it with
# replacement characters rather than buffering without bound.
MAX_PENDING_TOKENS = 32


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, an AddedToken dict {"content": ...}, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> list[int]:
    """An `eos_token_id` field: an int, a list of ints, or null."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, None when the file does not exist."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise TokenizerError(
            f"{path} is not valid JSON ({exc.__class__.__name__}); the download may be incomplete."
        ) from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} does not hold a JSON object; the model folder looks damaged.")
    return data


class StreamingDetokenizer:
    """Turns token ids into text one id at a time, emitting only text that later ids cannot change.

    Byte-level and byte-fallback tokenizers split emoji and CJK characters over several tokens; until the last
    byte arrives the decoded text ends in U+FFFD, so that tail is held back. Each new id is decoded together with
    a short context window (the previous emission's tokens, as vLLM and TGI do), which keeps leading-space
    rules of SentencePiece-style decoders right and makes the cost per token independent of the reply's length.
    Invariant: the concatenation of every `add()` and the final `flush()` equals `Tokenizer.decode(all ids)`.
    Two exceptions, both only for byte sequences that are not valid UTF-8 (garbage output): a byte-fallback
    decoder (`<0xNN>` tokens) turns a whole run of byte tokens into U+FFFDs once any byte in it is invalid, even
    bytes the stream already showed as text; and more than MAX_PENDING_TOKENS tokens without a complete character
    are emitted as they decode, so the stream never stalls.
    """

    def __init__(self, backend: tokenizers.Tokenizer, skip_special: bool, special_ids: frozenset[int]) -> None:
        self._backend = backend
        self._skip_special = skip_special
        self._special_ids = special_ids
        self._window: list[int] = []  # context tokens (already emitted) followed by pending tokens
        self._context_len = 0
        self._context_text = ""  # decode(window[:context_len])
        self._parts: list[str] = []

    def add(self, token_id: int) -> str:
        """Feed one generated id; return the text that became final (often "", never half a character)."""
        if self._skip_special and token_id in self._special_ids:
            # decode() drops these; keeping them out of the window also keeps them out of the decoder's context,
            # where a leading-space rule would otherwise treat the next token as the start of the text.
            return ""
        self._window.append(int(token_id))
        text = self._backend.decode(self._window, skip_special_tokens=self._skip_special)
        pending = len(self._window) - self._context_len
        if text.endswith("\ufffd") and pending < MAX_PENDING_TOKENS:
            return ""  # an incomplete character: wait for its remaining bytes
        return self._emit(text)

    def flush(self) -> str:
        """End of stream: return whatever is still held back (an incomplete character becomes U+FFFD)."""
        if len(self._window) == self._context_len:
            return ""
        return self._emit(self._backend.decode(self._window, skip_special_tokens=self._skip_special))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _emit(self, text: str) -> str:
        delta = text[len(self._context_text) :] if len(text) > len(self._context_text) else ""
        # The tokens just emitted become the next context; older ones are dropped so the window stays small.
        self._window = self._window[self._context_len :]
        self._context_len = len(self._window)
        self._context_text = self._backend.decode(self._window, skip_special_tokens=self._skip_special)
        if delta:
            self._parts.append(delta)
        return delta


class Tokenizer:
    """A model folder's tokenizer. Build it with `Tokenizer.from_dir(model_dir)`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None,
        special_tokens: dict[str, str],
        eos_ids: frozenset[int],
        content_hash: str,
    ) -> None:
        self._backend = backend
        self._chat_template = chat_template
        self._special_tokens = special_tokens  # template name ("bos_token", ...) -> token text
        bos = special_tokens.get("bos_token")
        self._bos_id = backend.token_to_id(bos) if bos is not None else None
        self._eos_ids = eos_ids
        self._content_hash = content_hash
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # Whether plain `encode(text)` starts with BOS, decided once by the post-processor's output for "".
        self._adds_bos = self._bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [
            self._bos_id
        ]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, generation_config.json and config.json from `model_dir`."""
        root = Path(model_dir)
        if not root.is_dir():
            raise TokenizerError(f"{root} is not a folder; choose a Hugging Face model folder.")
        tok_path = root / "tokenizer.json"
        try:
            tok_bytes = tok_path.read_bytes()
        except FileNotFoundError:
            if (root / "tokenizer.model").exists():
                raise TokenizerError(
                    f"{root} has only a SentencePiece tokenizer.model; add its tokenizer.json "
                    "(download it, or save one with transformers' AutoTokenizer.save_pretrained)."
                ) from None
            raise TokenizerError(
                f"{root} has no tokenizer.json; choose a complete Hugging Face model folder."
            ) from None
        except OSError as exc:
            raise TokenizerError(f"{tok_path} cannot be read ({exc.strerror or exc.__class__.__name__}).") from None
        try:
            backend = tokenizers.Tokenizer.from_str(tok_bytes.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception for any malformed file
            raise TokenizerError(
                f"{tok_path} is not a valid tokenizer ({_first_line(exc)}); the download may be incomplete."
            ) from None

        cfg_path = root / "tokenizer_config.json"
        cfg = _read_json(cfg_path) or {}
        gen = _read_json(root / "generation_config.json") or {}
        model_cfg = _read_json(root / "config.json") or {}

        special_tokens = {
            name: text for name in _TEMPLATE_TOKEN_NAMES if (text := _token_text(cfg.get(name))) is not None
        }
        chat_template = cls._read_chat_template(root, cfg)

        # Prompts must never be cut or padded behind the caller's back.
        backend.no_truncation()
        backend.no_padding()
        if "add_bos_token" in cfg or "add_eos_token" in cfg:
            cls._install_bos_eos(
                backend, special_tokens, bool(cfg.get("add_bos_token")), bool(cfg.get("add_eos_token"))
            )

        eos: set[int] = set(_ids(gen.get("eos_token_id"))) | set(_ids(model_cfg.get("eos_token_id")))
        eos_text = special_tokens.get("eos_token")
        if eos_text is not None and (eos_id := backend.token_to_id(eos_text)) is not None:
            eos.add(eos_id)

        digest = hashlib.sha256(tok_bytes)
        for extra in (cfg_path, root / "chat_template.jinja"):
            if extra.is_file():
                digest.update(extra.read_bytes())
        return cls(
            backend,
            chat_template=chat_template,
            special_tokens=special_tokens,
            eos_ids=frozenset(eos),
            content_hash=digest.hexdigest(),
        )

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF file carries in its metadata (vocabulary, merges or scores, specials, template)."""
        try:
            backend, special_tokens, eos_ids, add_bos, content_hash = tokenizer_parts(metadata)
            cls._install_bos_eos(backend, special_tokens, add_bos, False)
        except TokenizerError:
            raise
        except Exception as exc:  # tokenizers raises bare Exceptions for a vocabulary it cannot build
            raise TokenizerError(
                f"The GGUF's tokenizer cannot be built ({_first_line(exc)}); the file is damaged."
            ) from None
        template = metadata.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise TokenizerError("The GGUF's chat template is not text; the file looks damaged.")
        return cls(
            backend,
            chat_template=template or None,
            special_tokens=special_tokens,
            eos_ids=eos_ids,
            content_hash=content_hash,
        )

    @classmethod
    def load(cls, model_path: str | Path) -> Tokenizer:
        """The tokenizer of any model path: a Hugging Face folder, a .gguf file, or a folder holding one."""
        if is_gguf_model(model_path):
            return cls.from_gguf(gguf_model(model_path).tokenizer_metadata())
        return cls.from_dir(model_path)

    @staticmethod
    def _read_chat_template(root: Path, cfg: dict[str, Any]) -> str | None:
        """`chat_template.jinja` wins over tokenizer_config's `chat_template`, as in transformers."""
        jinja_path = root / "chat_template.jinja"
        try:
            return jinja_path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            pass
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{jinja_path} cannot be read as UTF-8 text ({exc.__class__.__name__}).") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):
            # Several named templates ({"name", "template"}): the conversation one is "default".
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(
                "tokenizer_config.json has a chat_template that is not text; the model folder looks damaged."
            )
        return template or None

    @staticmethod
    def _install_bos_eos(backend: tokenizers.Tokenizer, special: dict[str, str], add_bos: bool, add_eos: bool) -> None:
        """Make the post-processor add BOS/EOS exactly as tokenizer_config.json asks (as transformers 4 did)."""
        bos = special.get("bos_token") if add_bos else None
        eos = special.get("eos_token") if add_eos else None
        # Like transformers, a flag whose token is undefined or unknown to the vocabulary is dropped.
        bos_id = backend.token_to_id(bos) if bos is not None else None
        eos_id = backend.token_to_id(eos) if eos is not None else None
        head = f"{bos}:0 " if bos_id is not None else ""
        tail = f" {eos}:0" if eos_id is not None else ""
        head_b = f" {bos}:1" if bos_id is not None else ""
        tail_b = f" {eos}:1" if eos_id is not None else ""
        single = f"{head}$A:0{tail}"
        backend.post_processor = processors.TemplateProcessing(
            single=single,
            pair=f"{single}{head_b} $B:1{tail_b}",
            special_tokens=[(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None and i is not None],
        )

    # --- encoding ----------------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. Special-token text in `text` (e.g. "<|end|>") becomes that token, as in transformers.

        add_bos: None = the tokenizer's own default (its post-processor, or tokenizer_config's add_bos_token);
        True = start with BOS (a no-op when the tokenizer has no BOS token); False = no special tokens added.
        BOS is never doubled: text that already starts with the BOS token's text keeps just that one.
        """
        if add_bos is None:
            ids = self._backend.encode(text, add_special_tokens=True).ids
            if self._adds_bos and len(ids) > 1 and ids[1] == self._bos_id:
                del ids[0]
            return ids
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos and self._bos_id is not None and ids[:1] != [self._bos_id]:
            ids.insert(0, self._bos_id)
        return ids

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for `messages` (transformers' `apply_chat_template(tokenize=False)`).

        `extra` reaches the template as variables (e.g. `continue_final_message=True`, `tools=[...]`).
        """
        kwargs = {**self._special_tokens, **extra}
        return render_chat(self._chat_template, messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """Prompt ids for `messages`: the rendered template encoded without added special tokens, because the
        template writes its own BOS text (transformers' `apply_chat_template(tokenize=True)`)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra), add_bos=False)

    # --- decoding ----------------------------------------------------------------------------------------------

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def stream_decoder(self, skip_special: bool = True) -> StreamingDetokenizer:
        return StreamingDetokenizer(self._backend, skip_special, self._special_ids)

    def backend_json(self) -> str:
        """The tokenizer as `tokenizers` serializes it (tokenizer.json's form; grammar engines read it)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # --- properties --------------------------------------------------------------------------------------------

    @property
    def bos_id(self) -> int | None:
        """Id of tokenizer_config's bos_token; None when the tokenizer has none (e.g. Qwen2)."""
        return self._bos_id

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends a reply: tokenizer_config eos_token ∪ generation_config and config.json eos_token_id."""
        return self._eos_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of special added tokens (the ones `skip_special` drops)."""
        return self._special_ids

    @property
    def adds_bos(self) -> bool:
        """Whether `encode(text)` with the default `add_bos=None` starts with BOS."""
        return self._adds_bos

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def content_hash(self) -> str:
        """sha256 hex of tokenizer.json + tokenizer_config.json (+ chat_template.jinja when present) bytes:
        identifies the tokenizer for sessions."""
        return self._content_hash


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [exc.__class__.__name__])[0].rstrip(".")
