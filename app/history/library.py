"""The conversation library: every conversation's stored file in the data folder and an index of them (title,
dates, model, searchable text), owned by the GUI thread.

The worker writes each conversation's `.spark` file (atomically, compact) whenever it changes; the library only
keeps the index (`index.json`, also written atomically, on a writer thread of its own so an fsync never stalls
the window; writes keep their order) and moves files to and from a trash folder, so a Delete can
be undone until the app quits. Nothing read from the index becomes a path: a conversation's file name is derived
from its id, and ids are checked to be plain hex.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from app.settings.sampling_choice import SamplingChoice, choice_from_json
from engine import IMAGE_TOKEN, InvalidSamplingSettings, atomic_write, load_session

log = logging.getLogger(__name__)

INDEX_NAME = "index.json"
TRASH_NAME = "trash"
INDEX_VERSION = 1
TITLE_CHARS = 48
SEARCH_CHARS = 4000  # of each conversation's text kept in the index for search
MAX_INDEX_BYTES = 64 << 20
MAX_SCHEMA_CHARS = 64_000
MAX_ORIGIN_CHARS = 8192
_ID = re.compile(r"^[0-9a-f]{16}$")


CUT_OFF_NOTE = "Cut off: Spark stopped before this reply ended."


def new_id() -> str:
    return secrets.token_hex(8)


def title_from(text: str, chars: int = 0) -> str:
    """A conversation's title from its first message: the first line, shortened at a word (the markers that place
    its pictures are not words: a message of pictures alone is titled "Picture")."""
    chars = chars or TITLE_CHARS
    line = " ".join(text.replace(IMAGE_TOKEN, " ").strip().split())
    if len(line) <= chars:
        return line or ("Picture" if IMAGE_TOKEN in text else "New Chat")
    cut = line[:chars].rsplit(" ", 1)[0]
    return (cut if len(cut) > chars // 2 else line[:chars]) + "…"


@dataclass(frozen=True)
class ConversationEntry:
    id: str
    title: str
    created: float
    updated: float
    model: str
    text: str = ""  # the conversation's words (shortened), for search
    renamed: bool = False  # the user chose the title: the first message no longer sets it
    messages: int = 0
    notes: tuple[tuple[int, str], ...] = ()  # (message index, remark shown under it: "Stopped.", "↺ Recalled…")
    sampling: SamplingChoice | None = None  # the conversation's own sampling; None: it follows the app's setting
    reply_schema: str = ""  # "Reply as JSON" in this conversation: the schema its replies follow ("": off)
    origin: str = ""  # the file it was opened from, as `file_origin` names it ("": begun here)


def _entry(raw: object) -> ConversationEntry | None:
    """One index row, checked; None for anything malformed (the row is dropped, the file stays)."""
    if not isinstance(raw, dict):
        return None
    try:
        e = ConversationEntry(
            id=str(raw["id"]),
            title=str(raw["title"])[:500],
            created=float(raw["created"]),
            updated=float(raw["updated"]),
            model=str(raw.get("model", ""))[:200],
            text=str(raw.get("text", ""))[:SEARCH_CHARS],
            renamed=bool(raw.get("renamed", False)),
            messages=int(raw.get("messages", 0)),
            notes=tuple((int(i), str(t)[:500]) for i, t in raw.get("notes", [])[:10_000]),
            reply_schema=_schema_text(raw.get("reply_schema", "")),
            origin=str(raw.get("origin", ""))[:MAX_ORIGIN_CHARS],
        )
    except (KeyError, TypeError, ValueError):
        return None
    return e if _ID.match(e.id) else None


def file_origin(path: Path) -> str:
    """What names an opened file for "already in the history": where it is, its size and when it last changed (an
    edited file opens as a new conversation; the same file again selects the one it became)."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _schema_text(value: object) -> str:
    """A row's JSON-reply schema: a string of bounded size, else off (the engine checks it again before a reply
    uses it, and says so if it refuses it)."""
    return value if isinstance(value, str) and len(value) <= MAX_SCHEMA_CHARS else ""


def _stored_sampling(raw: dict[str, object]) -> tuple[SamplingChoice | None, str]:
    """A row's own sampling, checked: (the choice, "") or (None, why it cannot be used)."""
    value = raw.get("sampling")
    if value is None:
        return None, ""
    try:
        return choice_from_json(value), ""
    except (InvalidSamplingSettings, TypeError, ValueError) as exc:
        return None, str(exc)


class ConversationLibrary:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.trash = folder / TRASH_NAME
        self._entries: dict[str, ConversationEntry] = {}
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="library-index")
        self._closed = False
        self._pending_sampling: dict[str, SamplingChoice | None] = {}  # set before the conversation was first stored
        self._pending_schema: dict[str, str] = {}  # likewise, "Reply as JSON"
        self._pending_origin: dict[str, str] = {}  # likewise, the file a conversation being opened comes from
        self.load_error = ""  # one sentence when the index could not be read (the files are still there)

    # -- storage -----------------------------------------------------------------------------------------------------
    def load(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / INDEX_NAME
        self._entries = {}
        if path.is_file():
            try:
                if path.stat().st_size > MAX_INDEX_BYTES:
                    raise ValueError("too large")
                data = json.loads(path.read_text(encoding="utf-8"))
                rows = data.get("conversations", []) if isinstance(data, dict) else []
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                self.load_error = (
                    f"The list of conversations could not be read ({exc}); it was rebuilt from the stored files."
                )
                rows = []
            refused: list[tuple[str, str]] = []  # (title, why) of rows whose own sampling cannot be used
            for row in rows if isinstance(rows, list) else []:
                e = _entry(row)
                if e is not None and self.path_for(e.id).is_file():
                    choice, problem = _stored_sampling(row)
                    if problem:
                        refused.append((e.title, problem))
                    self._entries[e.id] = replace(e, sampling=choice)
            if refused and not self.load_error:
                self.load_error = _sampling_refused(refused)
        # Files without an index row (an index write lost in a crash) come back titled by their first question.
        for f in self.folder.glob("*.spark"):
            if _ID.match(f.stem) and f.stem not in self._entries:
                self._entries[f.stem] = _recovered(f)

    def save(self) -> None:
        data = {"version": INDEX_VERSION, "conversations": [asdict(e) for e in self.entries()]}
        raw = json.dumps(data, ensure_ascii=False).encode("utf-8")
        if self._closed:  # a last store reported after quit began: written here and now
            _write_index(self.folder / INDEX_NAME, raw)
        else:
            self._writer.submit(_write_index, self.folder / INDEX_NAME, raw)

    def flush(self) -> None:
        """Wait until every index write asked for so far is on disk."""
        if not self._closed:
            self._writer.submit(lambda: None).result()

    def path_for(self, conversation_id: str) -> Path:
        if not _ID.match(conversation_id):
            raise ValueError(f"not a conversation id: {conversation_id!r}")
        return self.folder / f"{conversation_id}.spark"

    # -- queries -----------------------------------------------------------------------------------------------------
    def entries(self, query: str = "") -> list[ConversationEntry]:
        """Newest first; with a query, only those whose title or words contain every word of it."""
        words = query.lower().split()
        rows = sorted(self._entries.values(), key=lambda e: e.updated, reverse=True)
        if words:
            rows = [e for e in rows if all(w in f"{e.title}\n{e.text}".lower() for w in words)]
        return rows

    def get(self, conversation_id: str) -> ConversationEntry | None:
        return self._entries.get(conversation_id)

    def sampling_for(self, conversation_id: str) -> SamplingChoice | None:
        """The conversation's own sampling (None: it follows the app's setting)."""
        e = self._entries.get(conversation_id)
        return e.sampling if e is not None else self._pending_sampling.get(conversation_id)

    def reply_schema(self, conversation_id: str) -> str:
        """The schema this conversation's replies follow ("": "Reply as JSON" is off in it)."""
        e = self._entries.get(conversation_id)
        return e.reply_schema if e is not None else self._pending_schema.get(conversation_id, "")

    def find_origin(self, origin: str) -> str | None:
        """The conversation opened from the file `origin` names (file_origin), if the history still has it."""
        return next((e.id for e in self._entries.values() if origin and e.origin == origin), None)

    # -- changes -----------------------------------------------------------------------------------------------------
    def record(
        self, conversation_id: str, messages: list[tuple[str, str]], model: str, cut_off: bool = False
    ) -> ConversationEntry:
        """The worker stored this conversation: (role, content) pairs as they now are; `cut_off`: its last reply
        was stopped before it ended (it keeps a note saying so)."""
        now = time.time()
        old = self._entries.get(conversation_id)
        title = old.title if old is not None and old.renamed else self._distinct_title(conversation_id, messages)
        text = "\n".join(c for _, c in messages)[:SEARCH_CHARS]
        notes = (
            tuple((i, t) for i, t in old.notes if i < len(messages)) if old else ()
        )  # a regenerated reply drops its note
        last = len(messages) - 1
        if cut_off and messages and messages[-1][0] == "assistant" and all(i != last for i, _ in notes):
            notes += ((last, CUT_OFF_NOTE),)
        e = ConversationEntry(
            conversation_id,
            title,
            old.created if old else now,
            now,
            model,
            text,
            bool(old and old.renamed),
            len(messages),
            notes,
            old.sampling if old else self._pending_sampling.pop(conversation_id, None),
            old.reply_schema if old else self._pending_schema.pop(conversation_id, ""),
            old.origin if old else self._pending_origin.pop(conversation_id, ""),
        )
        self._entries[conversation_id] = e
        self.save()
        return e

    def _distinct_title(self, conversation_id: str, messages: list[tuple[str, str]]) -> str:
        """The first question's words; where another conversation already bears them, the reply's first words
        follow, so rows that began alike still read apart."""
        first_user = next((c for r, c in messages if r == "user"), "")
        title = title_from(first_user)
        first_reply = next((c for r, c in messages if r == "assistant" and c.strip()), "")
        taken = any(e.title == title for cid, e in self._entries.items() if cid != conversation_id)
        if not taken or not first_reply:
            return title
        return title_from(f"{title.rstrip('…')} — {first_reply}", TITLE_CHARS + 24)

    def set_note(self, conversation_id: str, index: int, note: str) -> None:
        e = self._entries.get(conversation_id)
        if e is None:
            return
        notes = tuple((i, t) for i, t in e.notes if i != index) + (((index, note),) if note else ())
        self._entries[conversation_id] = replace(e, notes=notes)
        self.save()

    def set_sampling(self, conversation_id: str, choice: SamplingChoice | None) -> None:
        """Give the conversation its own sampling (None: back to the app's setting); one not stored yet gets it
        when it first is."""
        e = self._entries.get(conversation_id)
        if e is None:
            self._pending_sampling[conversation_id] = choice
            return
        self._entries[conversation_id] = replace(e, sampling=choice)
        self.save()

    def set_reply_schema(self, conversation_id: str, schema: str) -> None:
        """Turn "Reply as JSON" on in this conversation with `schema` ("": off); one not stored yet gets it when it
        first is."""
        e = self._entries.get(conversation_id)
        if e is None:
            self._pending_schema[conversation_id] = schema
            return
        self._entries[conversation_id] = replace(e, reply_schema=schema)
        self.save()

    def set_origin(self, conversation_id: str, origin: str) -> None:
        """The conversation about to be stored as `conversation_id` comes from the file `origin` names."""
        self._pending_origin[conversation_id] = origin

    def rename(self, conversation_id: str, title: str) -> None:
        e = self._entries.get(conversation_id)
        title = " ".join(title.split())[:200]
        if e is None or not title:
            return
        self._entries[conversation_id] = replace(e, title=title, renamed=True)
        self.save()

    def delete(self, conversation_id: str) -> ConversationEntry | None:
        """Move the conversation's file to the trash; returns its row for `undelete`."""
        e = self._entries.pop(conversation_id, None)
        if e is None:
            return None
        self.trash.mkdir(parents=True, exist_ok=True)
        try:
            shutil.move(str(self.path_for(conversation_id)), str(self.trash / f"{conversation_id}.spark"))
        except OSError:
            log.exception("could not move a deleted conversation to the trash")
        self.save()
        return e

    def undelete(self, entry: ConversationEntry) -> bool:
        src = self.trash / f"{entry.id}.spark"
        if not src.is_file():
            return False
        try:
            shutil.move(str(src), str(self.path_for(entry.id)))
        except OSError:
            log.exception("could not bring a deleted conversation back from the trash")
            return False
        self._entries[entry.id] = entry
        self.save()
        return True

    def close(self) -> None:
        """On quit: finish the index writes; deletions can no longer be undone, so their files go."""
        self._closed = True
        self._writer.shutdown(wait=True)
        shutil.rmtree(self.trash, ignore_errors=True)


def _sampling_refused(refused: list[tuple[str, str]]) -> str:
    title, why = refused[0]
    why = why.rstrip(".")
    why = why[:1].lower() + why[1:]
    if len(refused) == 1:
        return f"The sampling stored with “{title}” could not be used ({why}); it follows the app's setting now."
    return (
        f"The sampling stored with {len(refused)} conversations could not be used (“{title}”: {why}); "
        "they follow the app's setting now."
    )


def _recovered(path: Path) -> ConversationEntry:
    """A row for a stored file the index lost: its title, words and model read from the file itself."""
    when = path.stat().st_mtime
    try:
        data = load_session(path)
    except Exception:  # opening it says what is wrong; the row still lets the user try
        return ConversationEntry(path.stem, "Recovered conversation", when, when, "")
    messages = [(m.role, m.content) for m in data.messages]
    first_user = next((c for r, c in messages if r == "user"), "")
    model = data.extra.get("model") if isinstance(data.extra.get("model"), str) else ""
    text = "\n".join(c for _, c in messages)[:SEARCH_CHARS]
    return ConversationEntry(
        path.stem, title_from(first_user), when, when, str(model or ""), text, False, len(messages)
    )


def _write_index(path: Path, data: bytes) -> None:
    try:
        atomic_write(path, [data])
    except Exception:  # the files are the truth; a lost index row is recovered on the next load
        log.exception("could not write the conversation index")
