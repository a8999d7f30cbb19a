"""engine.fileio: the durable atomic write (through a FileSystem that fails or records) and the one safetensors
header reader, with every hostile header refused in one sentence by each of its callers (model weights, session
files, the persistent KV cache)."""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from engine.errors import ModelLoadError, SessionFileError
from engine.fileio import (
    FileSystem,
    HeaderError,
    HeaderFault,
    HeaderLimits,
    atomic_dir,
    atomic_path,
    atomic_write,
    read_header,
    read_header_file,
)
from engine.loading.weights import read_safetensors_header
from engine.memory.cascade.persistent import PersistentStore
from engine.session.file import load_session, save_session
from tests.engine.session.session_helpers import write_v2

# -- atomic writes -------------------------------------------------------------------------------------------------


class Recorder(FileSystem):
    """The real calls, with a log of what was fsynced and renamed, and an optional failure at one step."""

    def __init__(self, fail: str | None = None, fail_after_bytes: int | None = None) -> None:
        self.log: list[tuple[str, str]] = []
        self.names: dict[int, str] = {}
        self.fail = fail
        self.fail_after_bytes = fail_after_bytes
        self.written = 0

    def _maybe_fail(self, step: str) -> None:
        if self.fail == step:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    def mkstemp(self, folder: Path, prefix: str, suffix: str) -> tuple[int, str]:
        fd, name = super().mkstemp(folder, prefix, suffix)
        self.names[fd] = Path(name).name
        return fd, name

    def open(self, path: str | Path, flags: int) -> int:
        fd = super().open(path, flags)
        self.names[fd] = Path(path).name + ("/" if Path(path).is_dir() else "")
        return fd

    def write(self, fd: int, data: memoryview) -> int:
        if self.fail_after_bytes is not None and self.written >= self.fail_after_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = super().write(fd, data[:100])  # short writes: the writer must loop
        self.written += n
        return n

    def fsync(self, fd: int) -> None:
        self._maybe_fail("fsync")
        super().fsync(fd)
        self.log.append(("fsync", self.names[fd]))

    def replace(self, src: str | Path, dst: str | Path) -> None:
        self._maybe_fail("replace")
        super().replace(src, dst)
        self.log.append(("replace", Path(dst).name))

    def rename(self, src: str | Path, dst: str | Path) -> None:
        super().rename(src, dst)
        self.log.append(("rename", Path(dst).name))


def test_an_atomic_write_fsyncs_the_file_then_renames_then_fsyncs_the_folder(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    fs = Recorder()
    assert atomic_write(target, [b"a" * 250, b"b" * 7], prefix=".f.", fs=fs) == 257
    assert target.read_bytes() == b"a" * 250 + b"b" * 7
    (temp,) = {name for step, name in fs.log if step == "fsync" and not name.endswith("/")}
    assert temp.startswith(".f.") and temp != "f.bin"
    assert fs.log == [("fsync", temp), ("replace", "f.bin"), ("fsync", tmp_path.name + "/")]
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_crash_before_the_rename_keeps_the_previous_file(tmp_path: Path, step: str) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"previous")
    with pytest.raises(OSError, match="Input/output error"):
        atomic_write(target, [b"new" * 100], fs=Recorder(fail=step))
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # the temp file is gone


def test_a_full_disk_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"previous")
    fs = Recorder(fail_after_bytes=300)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, [b"x" * 1000], fs=fs)
    assert fs.written == 300  # it failed mid-write, after three short writes
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_an_interrupted_write_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"previous")

    def chunks() -> list[bytes]:
        raise KeyboardInterrupt  # not an OSError: still cleaned up, and re-raised as is

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, iter_of(chunks), fs=Recorder())
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def iter_of(make: Callable[[], list[bytes]]) -> Iterator[bytes]:
    yield from make()  # a generator: `make` runs (and raises) only once the write iterates it


def test_atomic_path_commits_what_the_body_wrote_and_discards_a_failed_body(tmp_path: Path) -> None:
    target = tmp_path / "lib.so"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(target, prefix="lib-", suffix=".so") as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the compiler failed")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["lib.so"]
    fs = Recorder()
    with atomic_path(target, prefix="lib-", suffix=".so", fs=fs) as tmp:
        tmp.write_bytes(b"new")  # written by name, as a compiler does
        assert target.read_bytes() == b"old"
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["lib.so"]
    assert fs.log == [("fsync", tmp.name), ("replace", "lib.so"), ("fsync", tmp_path.name + "/")]


def test_atomic_dir_fsyncs_every_file_before_the_rename(tmp_path: Path) -> None:
    final = tmp_path / "bundle"
    final.mkdir()
    (final / "old").write_text("old")
    fs = Recorder()
    with atomic_dir(final, fs=fs) as tmp:
        (tmp / "sub").mkdir(parents=True)
        (tmp / "a").write_text("a")
        (tmp / "sub" / "b").write_text("b")
    assert sorted(p.name for p in final.iterdir()) == ["a", "sub"] and [p.name for p in tmp_path.iterdir()] == [
        "bundle"
    ]
    renames = [i for i, (step, _) in enumerate(fs.log) if step == "rename"]
    synced = {name for step, name in fs.log[: renames[0]] if step == "fsync"}
    assert {"a", "b", "sub/"} <= synced  # every file (and folder) of the new bundle, before it is renamed in
    assert fs.log[-1] == ("fsync", tmp_path.name + "/")


# -- headers -------------------------------------------------------------------------------------------------------


def _image(header: dict[str, object], data: bytes, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _f32(start: int, end: int, shape: list[int], dtype: str = "F32") -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


# name -> (file bytes, the fault every caller must refuse it for)
HOSTILE: dict[str, tuple[bytes, HeaderFault]] = {
    "huge length": (struct.pack("<Q", 2**62) + b"{}" + b"\0" * 64, HeaderFault.HEADER_SIZE),
    "length past the end": (struct.pack("<Q", 500) + b"{}", HeaderFault.HEADER_SIZE),
    "non-JSON": (struct.pack("<Q", 8) + b"not json" + b"\0" * 16, HeaderFault.UNREADABLE),
    "NaN in JSON": (struct.pack("<Q", 3) + b"NaN", HeaderFault.UNREADABLE),
    "a list, not an object": (struct.pack("<Q", 2) + b"[]", HeaderFault.UNREADABLE),
    "unknown dtype": (_image({"w": _f32(0, 16, [4], "F8_E4M3")}, b"\0" * 16), HeaderFault.DTYPE),
    "shape x dtype is not the span": (_image({"w": _f32(0, 16, [5])}, b"\0" * 16), HeaderFault.SIZE),
    "offsets reversed": (_image({"w": _f32(16, 0, [4])}, b"\0" * 16), HeaderFault.SIZE),
    "offsets past the end": (_image({"w": _f32(0, 16, [4])}, b"\0" * 8), HeaderFault.PAST_END),
    "overlapping tensors": (_image({"a": _f32(0, 16, [4]), "b": _f32(8, 24, [4])}, b"\0" * 24), HeaderFault.OVERLAP),
    "a negative size": (_image({"w": _f32(0, 0, [-1])}, b""), HeaderFault.MALFORMED),
    "a float offset": (
        _image({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}}, b"\0" * 4),
        HeaderFault.MALFORMED,
    ),
    "a missing field": (_image({"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), HeaderFault.MALFORMED),
    "truncated": (b"\x10\0\0", HeaderFault.TRUNCATED),
}


def test_a_sound_header_is_read_with_absolute_offsets() -> None:
    image = st_save(
        {"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.float16)}, metadata={"m": "x"}
    )
    header = read_header(image, HeaderLimits(1 << 20, exact=True))
    assert header.metadata == {"m": "x"}
    a, b = header.tensors["a"], header.tensors["b"]
    assert (a.shape, a.torch_dtype, a.nbytes) == ((4,), torch.float32, 16) and (b.shape, b.nbytes) == ((2, 3), 12)
    assert torch.equal(
        torch.frombuffer(bytearray(image[a.start : a.end]), dtype=torch.float32), torch.arange(4, dtype=torch.float32)
    )


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_reader_names_each_hostile_header(case: str, tmp_path: Path) -> None:
    image, fault = HOSTILE[case]
    with pytest.raises(HeaderError) as err:
        read_header(image, HeaderLimits(1 << 20))
    assert err.value.fault is fault
    (tmp_path / "x").write_bytes(image)
    with pytest.raises(HeaderError) as err:
        read_header_file(tmp_path / "x", HeaderLimits(1 << 20))
    assert err.value.fault is fault


def test_exact_tiling_refuses_gaps_and_trailing_bytes() -> None:
    limits = HeaderLimits(1 << 20, exact=True)
    gap = _image({"a": _f32(0, 4, [1]), "b": _f32(8, 12, [1])}, b"\0" * 12)
    trailing = _image({"a": _f32(0, 4, [1])}, b"\0" * 5)
    for image in (gap, trailing):
        read_header(image, HeaderLimits(1 << 20))  # holes are allowed where the caller does not ask for tiling
        with pytest.raises(HeaderError) as err:
            read_header(image, limits)
        assert err.value.fault is HeaderFault.OVERLAP


def test_limits_bound_the_header_and_the_tensor_count() -> None:
    image = _image({f"t{i}": _f32(4 * i, 4 * i + 4, [1]) for i in range(5)}, b"\0" * 20)
    with pytest.raises(HeaderError) as err:
        read_header(image, HeaderLimits(1 << 20, max_tensors=4))
    assert err.value.fault is HeaderFault.TOO_MANY
    with pytest.raises(HeaderError) as err:
        read_header(image, HeaderLimits(64))
    assert err.value.fault is HeaderFault.HEADER_SIZE
    with pytest.raises(HeaderError) as err:
        read_header(image, HeaderLimits(1 << 20, dtypes=frozenset({"F16"})))
    assert err.value.fault is HeaderFault.DTYPE


def _one_sentence(text: str) -> None:
    assert "\n" not in text and "Traceback" not in text and text.endswith(".") and text.count(". ") == 0, text


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_model_weights_refuse_each_hostile_header_in_one_sentence(case: str, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(HOSTILE[case][0])
    with pytest.raises(ModelLoadError) as err:
        read_safetensors_header(path)
    _one_sentence(str(err.value))
    assert "model.safetensors" in str(err.value)


@pytest.fixture(scope="module")
def session_meta(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The metadata of a sound transcript-only session file: only its tensor section is made hostile below."""
    path = tmp_path_factory.mktemp("meta") / "t.spark"
    save_session(
        path,
        fingerprint="f" * 32,
        tokenizer_hash=None,
        messages=[{"role": "user", "content": "hi"}],
        system_prompt=None,
        settings={},
        memory_state=({"kind": "transcript"}, {}),
        pending_token=None,
        sampler_state=None,
        token_ids=[],
        compression="none",
    )
    raw = path.read_bytes()
    (meta_len,) = struct.unpack_from("<Q", raw, 12)
    return raw[68 : 68 + meta_len]


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_session_files_refuse_each_hostile_tensor_table_in_one_sentence(
    case: str, tmp_path: Path, session_meta: bytes
) -> None:
    path = tmp_path / "x.spark"
    write_v2(path, session_meta, HOSTILE[case][0])
    with pytest.raises(SessionFileError) as err:
        load_session(path)
    _one_sentence(str(err.value))
    assert str(err.value).startswith("The session file x.spark ") and "nothing was restored" in str(err.value)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_persistent_cache_drops_each_hostile_entry_with_one_warning(case: str, tmp_path: Path) -> None:
    store = PersistentStore(tmp_path, "m", "n")
    key = store.key("p")
    (tmp_path / "blocks" / f"{key}.safetensors").write_bytes(HOSTILE[case][0])
    store = PersistentStore(tmp_path, "m", "n")  # reopened: the entry is listed by the folder scan
    with pytest.warns(RuntimeWarning) as caught:
        assert store.get(key) is None
    (warning,) = caught
    text = str(warning.message)
    assert text.startswith("Dropped a persistent KV cache entry because it")
    _one_sentence(text)
    assert key not in store and not (tmp_path / "blocks" / f"{key}.safetensors").exists()
