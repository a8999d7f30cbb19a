"""One running app: a second launch hands its files over a local socket (plain sockets on the launching side, no
QApplication); junk, a silent peer and an over-long request are refused without opening anything; a socket left by
an app that is gone is taken over; a second server at the same place declines."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from app.__main__ import bring_forward
from app.misc import single_instance
from app.misc.single_instance import InstanceServer, hand_over, parse_request, socket_path
from tests.helpers.app_window import WAIT_MS


def _in_thread(fn):  # type: ignore[no-untyped-def]
    """Run a blocking client beside the GUI thread's event loop; its result lands in the returned list."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return out


def _raw(path: Path, data: bytes, close_after_send: bool = False) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(data)
        if close_after_send:
            s.shutdown(socket.SHUT_WR)
        answer = b""
        while True:
            chunk = s.recv(64)
            if not chunk:
                return answer
            answer += chunk


@pytest.fixture
def server(qtbot, tmp_path: Path):  # type: ignore[no-untyped-def]
    s = InstanceServer(socket_path(tmp_path / "cache"))
    assert s.listen()
    yield s
    s.close()


def test_a_second_launch_hands_its_files_over(qtbot, server: InstanceServer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    asked: list[list[Path]] = []
    server.files_requested.connect(asked.append)
    files = [tmp_path / "a.spark", tmp_path / "b model.gguf"]
    junk = _in_thread(lambda: _raw(server.path, b"\x00\xffGET / HTTP/1.1\r\n\r\n"))
    took = _in_thread(lambda: hand_over(server.path, files))
    qtbot.waitUntil(lambda: bool(took) and bool(junk), timeout=10_000)
    assert took == [True] and junk == [b"refused\n"]
    assert asked == [files]  # the junk opened nothing
    bare = _in_thread(lambda: hand_over(server.path, []))  # a launch without files: brings the window forward
    qtbot.waitUntil(lambda: bool(bare), timeout=10_000)
    assert bare == [True] and asked == [files, []]


def test_a_hostile_peer_is_refused(qtbot, server: InstanceServer, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(single_instance, "READ_TIMEOUT_MS", 100)
    asked: list[list[Path]] = []
    server.files_requested.connect(asked.append)
    big = _in_thread(lambda: _raw(server.path, b"[" * (single_instance.MAX_MESSAGE + 10)))
    silent = _in_thread(lambda: _raw(server.path, b'{"spark": 1, "open": []'))  # never ends its line
    relative = _in_thread(lambda: _raw(server.path, b'{"spark": 1, "open": ["../x.spark"]}\n'))
    qtbot.waitUntil(lambda: bool(big) and bool(silent) and bool(relative), timeout=10_000)
    assert big == silent == relative == [b"refused\n"] and asked == []


def test_requests_are_checked() -> None:
    ok = parse_request(b'{"spark": 1, "open": ["/tmp/a.spark"]}')
    assert ok == [Path("/tmp/a.spark")]
    for bad in (
        b"",
        b"[]",
        b'{"spark": 2, "open": []}',
        b'{"spark": 1, "open": "/tmp/a"}',
        b'{"spark": 1, "open": [1]}',
        b'{"spark": 1, "open": ["/tmp/a\\u0000b"]}',
        b'{"spark": 1, "open": [], "run": "rm -rf"}',
        b'{"spark": 1, "open": ["/a"' + b', "/a"' * 100 + b"]}",
        b"[" * 100_000,
    ):
        assert parse_request(bad) is None, bad[:40]


def test_a_stale_socket_is_taken_over_and_a_live_one_is_not(qtbot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = socket_path(tmp_path / "cache")
    path.parent.mkdir(parents=True, exist_ok=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # an app that crashed: its socket file stays, nobody listens
    dead.close()
    assert path.exists() and not hand_over(path, [])
    first = InstanceServer(path)
    assert first.listen()
    second = InstanceServer(path)
    assert not second.listen()  # the first answers there: the second launch should have handed over
    took = _in_thread(lambda: hand_over(path, []))
    qtbot.waitUntil(lambda: bool(took), timeout=10_000)
    assert took == [True]
    first.close()


def test_the_running_window_opens_what_a_second_launch_hands_over(
    qtbot, window, gui, dialogs, server: InstanceServer, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    with qtbot.waitSignal(gui(window.client.finished), timeout=WAIT_MS):
        assert window.submit("Hand me over")
    talk = tmp_path / "handed.spark"
    dialogs.save_to = talk
    with qtbot.waitSignal(gui(window.client.saved), timeout=WAIT_MS):
        window.menus.save_action.trigger()
    window.commands.new_chat()
    server.files_requested.connect(lambda files: bring_forward(window, files))
    with qtbot.waitSignal(gui(window.client.restored), timeout=WAIT_MS) as blocker:
        took = _in_thread(lambda: hand_over(server.path, [talk]))  # `python -m app handed.spark`, a second time
    assert took == [True] and blocker.args[0].path == talk and window.isVisible()
    assert "Hand me over" in window.chat.toPlainText()
