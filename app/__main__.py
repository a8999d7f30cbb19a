"""`python -m app [PATH ...] [--model DIR|FILE.gguf] [--backend NAME] [--self-test]`: the MLoT Spark window, or a
headless smoke run. PATHs are opened as Finder would: `.spark` conversations, model folders or `.gguf` models.

--self-test loads the model, streams a reply while timing the GUI thread (the longest gap of a 10 ms timer; the
goal is under 50 ms), saves and restores the session, times Stop while a long prompt is read and while a reply is
written, switching back to a conversation of over 4,000 tokens and reopening it in a new app process until its first
reply token (its memory kept, not recomputed), and Quit while a reply streams (the reply so far must be stored), and
exits 0; on failure it prints one line to stderr and exits 1. With --json it prints one JSON object of what it
measured instead of sentences.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from PySide6.QtCore import QCoreApplication, QSettings

from engine import AUTO_ORDER, GenerationSettings, KeptMemory, SamplingSettings, exit_process

if TYPE_CHECKING:
    from app.window.main_window import MainWindow

SELF_TEST_PROMPT = "Hello! In one sentence, what is a memory cascade?"
SELF_TEST_TOKENS = 48
LONG_PROMPT = "Summarise this note. " + "The lighthouse keeper logs the weather, the ships and the lamp. " * 120
GAP_GOAL_S = 0.050
STEP_TIMEOUT_MS = 300_000
KEPT_SENTENCE = (
    "The harbour town woke early: fishing boats went out before dawn, the baker opened at six, and the ferry to the "
    "islands left at half past seven, whatever the weather. "
)
KEPT_TOKENS = 4000  # the conversation switched back to and reopened is at least this long
QUIT_WAIT_MS = 800  # Quit waits this long for the workers (a reply stops within one step and is stored)  # a cold bundled-model load on a slow disk may take a while


class SelfTestFailure(Exception):
    """One line for stderr."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app", description="MLoT Spark: chat with a local memory-cascade model.")
    p.add_argument(
        "paths", nargs="*", type=Path, help=".spark conversations to open, or a model folder / .gguf to load"
    )
    p.add_argument(
        "--model", type=Path, help="model folder or .gguf file (default: the last one used, else the default model)"
    )
    p.add_argument("--backend", default="auto", choices=("auto", *AUTO_ORDER), help="compute backend (default: auto)")
    p.add_argument("--self-test", action="store_true", help="headless smoke run: load, stream, save, restore, exit")
    p.add_argument("--json", action="store_true", help="with --self-test: print one JSON object of the figures")
    # The self-test's second app process: reopen conversation ID of WORKDIR's data folder, print what it measured.
    p.add_argument("--reopen-probe", nargs=2, metavar=("WORKDIR", "ID"), help=argparse.SUPPRESS)
    # Qt's own options (-style, -platform ...) pass through to QApplication.
    args, qt_args = p.parse_known_args(argv)
    args.qt_args = qt_args
    return args


def self_test(
    window: MainWindow, model: Path | None, backend: str, workdir: Path, say: Callable[[str], None]
) -> dict[str, float | int | str]:
    """Returns what it measured; raises SelfTestFailure."""
    from app.misc.gap_meter import GapMeter
    from app.misc.signal_wait import wait_any
    from app.worker.types import LoadedModel, TurnResult

    w = window.client
    name, value = wait_any(
        {"loaded": w.loaded, "error": w.error}, STEP_TIMEOUT_MS, lambda: window.load_model(model, backend)
    )
    if name != "loaded" or not isinstance(value, LoadedModel):
        raise SelfTestFailure(f"the model did not load: {value or 'timed out'}")
    say(f"model: {value.info.name} on {value.info.backend_detail}")
    count_tokens = value.count_tokens
    figures: dict[str, float | int | str] = {"model": value.info.name, "backend": value.info.backend}

    meter = GapMeter()
    meter.start()
    name, result = wait_any(
        {"finished": w.finished, "error": w.error}, STEP_TIMEOUT_MS, lambda: window.submit(SELF_TEST_PROMPT)
    )
    gap = meter.stop()
    if name != "finished" or not isinstance(result, TurnResult) or result.reason == "error":
        raise SelfTestFailure(f"the reply failed: {result if name == 'error' else name}")
    reply = window.chat.reply_text()
    if not result.progress.generated_tokens:
        raise SelfTestFailure("the model generated no tokens")
    figures |= {
        "generated_tokens": result.progress.generated_tokens,
        "tokens_per_s": round(result.progress.tokens_per_s, 1),
        "ttft_ms": round(result.progress.ttft_s * 1000, 1),
        "longest_gui_gap_ms": round(gap * 1000, 1),
    }
    say(
        f"streamed {result.progress.generated_tokens} tokens at {result.progress.tokens_per_s:.1f} tokens/s, first after {result.progress.ttft_s * 1000:.0f} ms"
    )
    say(
        f"longest GUI gap while streaming: {gap * 1000:.1f} ms (goal < {GAP_GOAL_S * 1000:.0f} ms, {meter.ticks} ticks)"
    )

    path = workdir / "self-test.spark"
    name, value = wait_any({"saved": w.saved, "error": w.error}, STEP_TIMEOUT_MS, lambda: window.client.save(path))
    if name != "saved":
        raise SelfTestFailure(f"saving the session failed: {value or name}")
    window.client.new_chat(None)
    name, value = wait_any(
        {"restored": w.restored, "error": w.error, "foreign": w.foreign_session},
        STEP_TIMEOUT_MS,
        lambda: window.client.restore(path),
    )
    if name != "restored":
        raise SelfTestFailure(f"restoring the session failed: {value or name}")
    if window.chat.reply_text() != reply:
        raise SelfTestFailure("the restored conversation differs from the one saved")
    say(f"saved and restored {path.name} ({path.stat().st_size:,} bytes)")
    figures["stop_while_reading_ms"] = _time_stop(window, reading=True)
    say(f"Stop while a long prompt is read: the turn ended {figures['stop_while_reading_ms']} ms later")
    figures["stop_while_decoding_ms"] = _time_stop(window, reading=False)
    say(f"Stop while a reply is written: the turn ended {figures['stop_while_decoding_ms']} ms later")
    figures |= time_kept_memory(window, count_tokens, model, backend, workdir)
    say(
        f"switching back to a {figures['kept_conversation_tokens']:,}-token conversation: {figures['switch_back_ms']} ms; "
        f"reopening it in a new app process: {figures['reopen_after_relaunch_ms']} ms to the first reply token, "
        f"{figures['reopen_tokens']} tokens recomputed"
    )
    return figures


def time_kept_memory(
    window: MainWindow, count_tokens: Callable[[str], int], model: Path | None, backend: str, workdir: Path
) -> dict[str, float | int | str]:
    """A conversation of over KEPT_TOKENS tokens: away and back (ms until it is shown with its memory), then opened
    by a new app process over the same data and cache folders (ms from asking until the first reply token, and the
    tokens it recomputed first)."""
    import subprocess

    from app.misc.signal_wait import wait_any
    from app.worker.types import TurnResult

    w = window.client
    per = count_tokens(KEPT_SENTENCE)
    window.prefs.set_generation(GenerationSettings(max_tokens=8, sampling=SamplingSettings(seed=0)))
    window.commands.new_chat()
    prompt = KEPT_SENTENCE * (KEPT_TOKENS * 11 // 10 // max(1, per) + 2)  # sentences merge a little when joined
    name, result = wait_any({"finished": w.finished, "error": w.error}, STEP_TIMEOUT_MS, lambda: window.submit(prompt))
    if name != "finished" or not isinstance(result, TurnResult) or result.memory_tokens < KEPT_TOKENS:
        raise SelfTestFailure(f"the {KEPT_TOKENS:,}-token conversation was not written: {result or name}")
    first = window.state.current_id
    window.commands.new_chat()  # away: the conversation's memory is kept (in RAM, and on disk)
    recomputed: list[object] = []
    window.client.reading.connect(lambda p: recomputed.append(p) if p.kind == "restore" else None)
    t0 = time.perf_counter()
    name, value = wait_any(
        {"restored": w.restored, "error": w.error}, STEP_TIMEOUT_MS, lambda: window.open_conversation(first)
    )
    switch = (time.perf_counter() - t0) * 1000
    if name != "restored" or recomputed:
        raise SelfTestFailure(f"switching back did not hand the memory back: {value or name}")
    if window.dialogs.kept is not None:  # as after a quit: its copy on disk has landed before the relaunch reads it
        wait_kept(window.dialogs.kept.kept, window.library.path_for(first))
    cmd = [sys.executable, "-m", "app", "--reopen-probe", str(workdir), first, "--backend", backend]
    if model is not None:
        cmd += ["--model", str(model)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_MS / 1000, check=False)
    if proc.returncode != 0:
        raise SelfTestFailure(f"the reopening app process failed: {proc.stderr.strip()[-300:]}")
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "kept_conversation_tokens": result.memory_tokens,
        "switch_back_ms": round(switch, 1),
        "reopen_after_relaunch_ms": probe["reopen_after_relaunch_ms"],
        "reopen_tokens": probe["reopen_tokens"],
        "reopen_memory": probe["memory"],
    }


def wait_kept(kept: KeptMemory, conversation: Path) -> None:
    """Until `conversation`'s memory is on disk (its write is queued once the worker has been idle a moment)."""
    deadline = time.monotonic() + STEP_TIMEOUT_MS / 1000
    while kept.pending(conversation) is not None or not kept.entry_path(conversation).is_file():
        if time.monotonic() > deadline:
            raise SelfTestFailure("the conversation's memory was not kept on disk")
        QCoreApplication.processEvents()
        time.sleep(0.05)


def reopen_probe(model: Path | None, backend: str, workdir: Path, conversation_id: str) -> dict[str, float | int | str]:
    """The self-test's new app process: a window over `workdir`'s data and cache folders (its own settings), the
    model loaded, then conversation `conversation_id` opened and a message sent: ms from opening to the first reply
    token, and the tokens the model recomputed to open it."""
    from app.misc.signal_wait import wait_any
    from app.misc.standarddirs import StandardDirs
    from app.settings.preferences import Preferences
    from app.wiring import build_main_window
    from app.worker.types import LoadedModel

    prefs = Preferences(QSettings(str(workdir / "probe-settings.ini"), QSettings.Format.IniFormat))
    prefs.set_generation(GenerationSettings(max_tokens=4, sampling=SamplingSettings(seed=0)))
    window = build_main_window(prefs, StandardDirs(cache=workdir / "cache", data=workdir / "data", documents=workdir))
    w = window.client
    try:
        name, value = wait_any(
            {"loaded": w.loaded, "error": w.error}, STEP_TIMEOUT_MS, lambda: window.load_model(model, backend)
        )
        if name != "loaded" or not isinstance(value, LoadedModel):
            raise SelfTestFailure(f"the model did not load: {value or name}")
        t0 = time.perf_counter()
        name, value = wait_any(
            {"restored": w.restored, "error": w.error},
            STEP_TIMEOUT_MS,
            lambda: window.open_conversation(conversation_id),
        )
        if name != "restored":
            raise SelfTestFailure(f"the conversation did not reopen: {value or name}")
        session = window.client.worker.session  # idle now: read between requests
        if session is None:
            raise SelfTestFailure("the reopened conversation has no local memory")
        computed, memory = session.computed.count, session.memory_source
        name, value = wait_any(
            {"delta": w.delta, "error": w.error}, STEP_TIMEOUT_MS, lambda: window.submit("And then?")
        )
        took = (time.perf_counter() - t0) * 1000
        if name != "delta":
            raise SelfTestFailure(f"the reopened conversation did not answer: {value or name}")
        return {"reopen_after_relaunch_ms": round(took, 1), "reopen_tokens": computed, "memory": memory}
    finally:
        window.shutdown()


def _time_stop(window: MainWindow, reading: bool) -> float:
    """Milliseconds from Stop (pressed on the GUI thread) to the turn's end, while a long prompt is read or while a
    reply is written."""
    from PySide6.QtCore import QEventLoop, QTimer

    from app.worker.types import ReadProgress, TurnResult

    window.prefs.set_generation(GenerationSettings(max_tokens=2000, sampling=SamplingSettings(seed=0)))
    loop = QEventLoop()
    stopped_at: list[float] = []
    ended: list[float] = []

    def stop() -> None:
        if not stopped_at:
            stopped_at.append(time.perf_counter())
            window.stop_reply()

    def on_reading(p: ReadProgress) -> None:
        if reading and 0 < p.done < p.total:
            stop()

    def on_delta(_text: str) -> None:
        if not reading:
            stop()

    def on_finished(_r: TurnResult) -> None:
        ended.append(time.perf_counter())
        loop.quit()

    window.client.reading.connect(on_reading)
    window.client.delta.connect(on_delta)
    window.client.finished.connect(on_finished)
    QTimer.singleShot(STEP_TIMEOUT_MS, loop.quit)
    window.commands.new_chat()
    window.submit(LONG_PROMPT if reading else "Tell me a long story about a lighthouse keeper.")
    loop.exec()
    window.client.reading.disconnect(on_reading)
    window.client.delta.disconnect(on_delta)
    window.client.finished.disconnect(on_finished)
    if not stopped_at or not ended:
        raise SelfTestFailure(
            f"Stop while {'reading' if reading else 'writing'} was not measured (the turn ended first)"
        )
    return round((ended[0] - stopped_at[0]) * 1000, 1)


def time_quit_while_streaming(window: MainWindow, library_folder: Path) -> float:
    """Milliseconds Quit takes while a reply streams; the reply so far must be stored with its title."""
    from PySide6.QtCore import QEventLoop, QTimer

    from app.history.library import CUT_OFF_NOTE, ConversationLibrary

    window.prefs.set_generation(GenerationSettings(max_tokens=2000, sampling=SamplingSettings(seed=0)))
    loop = QEventLoop()
    window.coalescer.flushed.connect(lambda _t: loop.quit())
    QTimer.singleShot(STEP_TIMEOUT_MS, loop.quit)
    window.commands.new_chat()
    window.submit("Write a long poem about the sea.")
    loop.exec()
    cid = window.state.current_id
    t0 = time.perf_counter()
    window.shutdown()
    took = round((time.perf_counter() - t0) * 1000, 1)
    after = ConversationLibrary(library_folder)
    after.load()
    entry = after.get(cid)
    if (
        entry is None
        or not entry.title.startswith("Write a long poem")
        or CUT_OFF_NOTE not in dict(entry.notes).values()
    ):
        raise SelfTestFailure("the reply cut off by Quit was not stored with its title and a cut-off note")
    return took


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.self_test or args.reopen_probe:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

    from PySide6.QtWidgets import QSystemTrayIcon

    from app.application import CrashReporter, SparkApplication
    from app.misc.icons import tray_icon
    from app.misc.single_instance import InstanceServer, hand_over, socket_path
    from app.misc.standarddirs import StandardDirs
    from app.server.local_server import install_local_server_menu
    from app.settings.preferences import Preferences
    from app.tray.quick_prompt import QuickPromptTray
    from app.wiring import build_main_window

    if not args.self_test:  # a second launch hands its files to the running app, which opens them, and ends here
        files = [p.expanduser().resolve() for p in args.paths]
        if args.model is None and hand_over(socket_path(StandardDirs.from_platform().cache), files):
            print(
                "MLoT Spark is already running; " + ("it opens them there." if files else "its window comes forward.")
            )
            return 0
    app = SparkApplication([sys.argv[0], *args.qt_args])
    if args.reopen_probe:
        try:
            probe = reopen_probe(args.model, args.backend, Path(args.reopen_probe[0]), args.reopen_probe[1])
        except SelfTestFailure as exc:
            print(f"reopen probe failed: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(probe))
        return 0
    if args.self_test:
        with tempfile.TemporaryDirectory(prefix="spark-self-test-") as tmp:
            workdir = Path(tmp)
            # Scratch settings and data: a smoke run must not touch the user's preferences or conversations.
            prefs = Preferences(QSettings(str(workdir / "settings.ini"), QSettings.Format.IniFormat))
            prefs.set_generation(GenerationSettings(max_tokens=SELF_TEST_TOKENS, sampling=SamplingSettings(seed=0)))
            dirs = StandardDirs(cache=workdir / "cache", data=workdir / "data", documents=workdir)
            dirs.ensure()
            window = build_main_window(prefs, dirs)
            say: Callable[[str], None] = (lambda _s: None) if args.json else print
            try:
                figures = self_test(window, args.model, args.backend, workdir, say)
                # What the app holds after its replies and stops (the inspector's "Spark uses" figure).
                figures["rss_mb"] = round(psutil.Process().memory_info().rss / 2**20, 1)
                say(f"Memory held: {figures['rss_mb']} MB")
                figures["quit_while_streaming_ms"] = time_quit_while_streaming(window, dirs.conversations)
                say(f"Quit while a reply streams: {figures['quit_while_streaming_ms']} ms, the reply so far stored")
            except SelfTestFailure as exc:
                print(f"self-test failed: {exc}", file=sys.stderr)
                return 1
            finally:
                window.shutdown()
        print(json.dumps(figures) if args.json else "self-test passed")
        return 0

    dirs = StandardDirs.from_platform()
    dirs.ensure()
    CrashReporter(dirs.crash_log).install()
    prefs = Preferences(QSettings())
    app.set_appearance(prefs.appearance())
    window = build_main_window(prefs, dirs)
    app.aboutToQuit.connect(lambda: window.shutdown(QUIT_WAIT_MS))
    app.connect_file_opens(window.open_file)
    instance = InstanceServer(socket_path(dirs.cache), app)
    instance.listen()  # when it cannot, this app still runs; later launches start apps of their own
    instance.files_requested.connect(lambda files: bring_forward(window, files))
    app.aboutToQuit.connect(instance.close)
    tray = None
    if QSystemTrayIcon.isSystemTrayAvailable():
        tray = QuickPromptTray(tray_icon(), window)
        tray.quick_prompt_requested.connect(window.open_quick_prompt)
        tray.show_window_requested.connect(window.show)
        tray.show_window_requested.connect(window.raise_)
        tray.quit_requested.connect(app.quit)
        install_local_server_menu(tray.contextMenu(), window.local_server)
        window.local_server.failed.connect(lambda message: tray.showMessage("MLoT Spark", message))
        tray.show()
    # With a menu-bar item the app lives on when its window closes (as on macOS); without one, closing quits.
    app.setQuitOnLastWindowClosed(tray is None)
    window.show()
    open_startup(window, args, prefs.last_model())
    code = app.exec()
    if not window.workers_done:  # a model still loading: the conversation is stored; no need to wait for it
        logging.getLogger(__name__).warning("quitting while a model still loads")
        os._exit(code)
    return code


def bring_forward(window: MainWindow, files: list[Path]) -> None:
    """Another launch's files: the window comes forward and opens them (a model loads; a conversation already in the
    history is selected there)."""
    window.show()
    window.raise_()
    window.activateWindow()
    for path in files:
        window.open_file(path)


def open_startup(window: MainWindow, args: argparse.Namespace, last_model: Path | None) -> None:
    """Load the model (--model, else a model among the paths, else the last one used) and open the other paths
    (`.spark` files wait until the model is ready)."""
    from app.window.conversation_presenter import is_model_path

    models = [p for p in args.paths if is_model_path(p)]
    window.load_model(args.model or (models[0] if models else None) or last_model, args.backend)
    for path in args.paths:
        if path not in models:
            window.open_file(path.expanduser().resolve())


if __name__ == "__main__":
    exit_process(main())
