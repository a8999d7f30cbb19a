"""`python -m engine chat` — a terminal chat over the same Session the app uses.

Commands inside the chat: /new (forget the conversation), /system TEXT, /image FILE (a picture the next message is
about, on a model that sees images), /attach FILE (a document the model may draw on), /recall FILE (an earlier
conversation, likewise), /save FILE, /load FILE, /quit.
Ctrl-C stops the reply being generated; Ctrl-D (or /quit) leaves.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from engine.cli.checks import check_text
from engine.cli.generate import add_model_args, add_sampling_args, open_engine, settings_from_args
from engine.documents.attach import Attachments, Reattacher
from engine.errors import SparkError
from engine.loading.model_files import display_name, resolve_model_path
from engine.session.engine import Session
from engine.vision.images import DecodedImage, decode_file


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("chat", help="chat with the model in the terminal")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default="", help="system prompt")
    p.set_defaults(func=run)


class Chat:
    """The session, what it has attached (kept with the memory it joined: a /load starts them afresh) and the
    pictures the next message is about (/image)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.attachments: Attachments | None = None
        self.images: list[DecodedImage] = []

    def attached(self) -> Attachments:
        if self.attachments is None or self.attachments.memory is not self.session.memory:
            self.attachments = Attachments(self.session.memory, self.session.tokenizer, self.session.attachments)
        return self.attachments


def handle_command(session: Session, line: str, chat: Chat | None = None) -> bool:
    """Run a /command; returns False when the chat should end."""
    cmd, _, arg = line.partition(" ")
    arg = arg.strip()
    if cmd == "/quit":
        return False
    if cmd == "/new":
        session.reset()
        print("(new conversation)")
    elif cmd == "/system":
        session.system_prompt = arg
        print("(system prompt set)")
    elif cmd == "/save" and arg:
        session.save(Path(arg))
        print(f"(saved to {arg})")
    elif cmd == "/load" and arg:
        found = Reattacher()
        report = session.load(Path(arg), reattach=found)
        if chat is not None:
            chat.attached().restored(found.found)
        print(f"({report.message})")
    elif cmd == "/image" and arg and chat is not None:
        if session.engine.vision is None:
            raise SparkError(
                f"{display_name(session.engine.model_dir)} reads text only; choose a model that sees images."
            )
        chat.images.append(decode_file(Path(arg)))
        print(f"(image {Path(arg).name} attached to the next message)")
    elif cmd in ("/attach", "/recall") and arg and chat is not None:
        attachments = chat.attached()
        item = (attachments.attach_file if cmd == "/attach" else attachments.recall_session)(Path(arg))
        cap = item.capsule
        for note in attachments.notes:
            print(f"note: {note}", file=sys.stderr)
        attachments.notes.clear()
        how = f"read {cap.read_tokens:,} tokens" if cap.read_tokens else "read before: nothing to read"
        print(f"({cap.name}: {cap.tokens:,} tokens attached, {how})")
    else:
        print("commands: /new, /system TEXT, /image FILE, /attach FILE, /recall FILE, /save FILE, /load FILE, /quit")
    return True


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, resolve_model_path(args.model))  # bad flags fail before any loading
    engine = open_engine(args)
    session = engine.new_session()
    check_text(args.system, "--system")
    session.system_prompt = args.system
    chat = Chat(session)
    print(
        f"MLoT Spark — {display_name(engine.model_dir)} on {engine.choice.explain()}. /quit to leave.", file=sys.stderr
    )
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return 0
        except UnicodeDecodeError:  # the terminal sent bytes that are not UTF-8: say so, keep the chat
            print("error: That line is not valid UTF-8 text; check the terminal's encoding.", file=sys.stderr)
            continue
        if not line:
            continue
        try:
            if line.startswith("/"):
                if not handle_command(session, line, chat):
                    return 0
                continue
            stop = threading.Event()
            # Ctrl-C during a reply only sets the flag: the loop stops between tokens, never mid-step, so the
            # conversation's memory stays consistent for the next turn.
            previous = signal.signal(signal.SIGINT, lambda *_, flag=stop: flag.set())  # this turn's flag, bound now
            attachments = chat.attachments
            if attachments is None or not attachments.items or attachments.memory is not session.memory:
                attachments = None
            try:
                sent, chat.images[:] = list(chat.images), []
                for i, ev in enumerate(session.chat(line, settings, should_stop=stop.is_set, images=sent)):
                    if i == 0 and attachments is not None:
                        attachments.observe()
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
            finally:
                signal.signal(signal.SIGINT, previous)
            print(" [stopped]" if stop.is_set() else "")
            if attachments is not None and attachments.recalled:
                print("(recalled: " + "; ".join(c.label() for c in attachments.recalled) + ")", file=sys.stderr)
        except SparkError as exc:  # a bad command or file must not end the chat
            print(f"error: {exc}", file=sys.stderr)
