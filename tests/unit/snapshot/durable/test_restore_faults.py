"""Restore when reads fail or a payload cannot be loaded (issue 9, cases 1 and 4).

A read error is not corruption: it is retried by the store and, if it persists,
restore raises; it never falls back to an older snapshot, never logs
``snapshot.corrupt`` and never deletes anything. A payload whose checksum
verifies but that ``torch.load(weights_only=True)`` refuses stops the run
(``SnapshotUnloadable``, exit 78) instead of falling back. Faults are injected
into the store's fsspec file system (a mock: unit tests), below the store's own
retry policy, so the real retry and error translation run.
"""

from __future__ import annotations

import errno
import io
import os
import pathlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core import layout
from elastictrain.core.errors import (
    EXIT_FATAL,
    SnapshotCorrupt,
    SnapshotUnloadable,
    StorageError,
    StoragePermissionError,
    StorageTransientError,
)
from elastictrain.snapshot.durable.restore import load_newest
from elastictrain.snapshot.format.reader import list_snapshot_dirs, read_manifest
from elastictrain.storage import FsspecStore, open_store
from elastictrain.worker.dist import DistContext
from tests.planted import plant_snapshot

SINGLE = DistContext(0, 1, 0, "gloo", torch.device("cpu"), False)


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FsspecStore]:
    # Two quick retries: the real policy, without seconds of backoff.
    url = str(tmp_path / "run") if request.param == "local" else \
        f"memory://restore-{os.getpid()}-{id(request)}"
    s = open_store(url, retries=2, retry_backoff_s=0.001)
    yield s
    if request.param == "memory":
        s.delete("", recursive=True)


def save(store: FsspecStore, step: int) -> None:
    plant_snapshot(store, step, {"step": step, "w": torch.full((64,), float(step))})


def payload_path(store: FsspecStore, step: int) -> str:
    return f"{layout.step_dir(step)}/{read_manifest(store, step).objects[0].name}"


def fail_opens(monkeypatch: pytest.MonkeyPatch, store: FsspecStore, path: str,
               make_error: Callable[[], Exception], times: int | None = None) -> list[int]:
    """Opening ``path`` raises ``make_error()`` (``times`` times, or always); returns
    a list that counts the failed opens."""
    full = store._full(path)
    real_open = store.fs.open
    failed: list[int] = []

    def open_(target: str, *args: Any, **kwargs: Any) -> Any:
        if str(target).rstrip("/").endswith(full.lstrip("/")) and (
                times is None or len(failed) < times):
            failed.append(1)
            raise make_error()
        return real_open(target, *args, **kwargs)

    monkeypatch.setattr(store.fs, "open", open_)
    return failed


def snapshot_files(store: FsspecStore) -> dict[int, list[str]]:
    return {s: store.list_dir(layout.step_dir(s)) for s in list_snapshot_dirs(store)}


@pytest.mark.parametrize(("fault", "raised"), [
    (lambda: TimeoutError("read timed out"), StorageTransientError),
    (lambda: OSError(errno.EIO, "Input/output error"), StorageTransientError),
    (lambda: PermissionError(errno.EACCES, "Access Denied"), StoragePermissionError),
])
def test_a_persistent_read_error_fails_the_restore_and_never_falls_back(
        store: FsspecStore, monkeypatch: pytest.MonkeyPatch, fault: Callable[[], Exception],
        raised: type[StorageError]) -> None:
    save(store, 10)
    save(store, 20)
    before = snapshot_files(store)
    failed = fail_opens(monkeypatch, store, payload_path(store, 20), fault)
    with capture_logs() as logs, pytest.raises(raised) as info:
        load_newest(store, SINGLE)
    events = [e["event"] for e in logs]
    assert "snapshot.corrupt" not in events and "snapshot.discovered" not in events
    transient = raised is StorageTransientError
    assert len(failed) == (3 if transient else 1)  # retried by the store's policy, or not
    assert events.count("storage.retry") == (2 if transient else 0)
    assert "step_000000000020" in str(info.value)
    assert snapshot_files(store) == before  # nothing deleted because a read failed


def test_a_read_error_that_clears_within_the_retries_restores_the_newest(
        store: FsspecStore, monkeypatch: pytest.MonkeyPatch) -> None:
    save(store, 10)
    save(store, 20)
    failed = fail_opens(monkeypatch, store, payload_path(store, 20),
                        lambda: ConnectionResetError(errno.ECONNRESET, "reset"), times=2)
    loaded = load_newest(store, SINGLE)
    assert loaded is not None and loaded.step == 20 and len(failed) == 2
    assert torch.equal(loaded.payload["w"], torch.full((64,), 20.0))


class _FailingFile(io.RawIOBase):
    """A file that reads ``good`` bytes, then fails every read with EIO (a dropped
    connection in the middle of a download)."""

    def __init__(self, inner: Any, good: int) -> None:
        super().__init__()
        self._inner, self._left = inner, good

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self._inner.seek(offset, whence))

    def tell(self) -> int:
        return int(self._inner.tell())

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._left <= 0:
            raise OSError(errno.EIO, "connection dropped")
        n = int(self._inner.readinto(view[:self._left]))
        self._left -= n
        return n

    def close(self) -> None:
        self._inner.close()
        super().close()


def test_a_read_that_fails_while_loading_is_a_read_error_not_corruption(
        store: FsspecStore, monkeypatch: pytest.MonkeyPatch) -> None:
    save(store, 10)
    save(store, 20)
    full = store._full(payload_path(store, 20))
    real_open = store.fs.open

    def open_(target: str, *args: Any, **kwargs: Any) -> Any:
        f = real_open(target, *args, **kwargs)
        return _FailingFile(f, 200) if str(target).endswith(full.lstrip("/")) else f

    monkeypatch.setattr(store.fs, "open", open_)
    with capture_logs() as logs, pytest.raises(StorageError) as info:
        load_newest(store, SINGLE)
    assert not isinstance(info.value, SnapshotCorrupt)
    assert "snapshot.corrupt" not in [e["event"] for e in logs]
    assert list_snapshot_dirs(store) == [20, 10]


def test_a_corrupt_newest_snapshot_still_falls_back(store: FsspecStore) -> None:
    save(store, 10)
    save(store, 20)
    path = payload_path(store, 20)
    data = store.read_bytes(path)
    store.write_bytes(path, data[:-1] + bytes([data[-1] ^ 1]))
    with capture_logs() as logs:
        loaded = load_newest(store, SINGLE)
    assert loaded is not None and loaded.step == 10
    assert [e["snapshot_step"] for e in logs if e["event"] == "snapshot.corrupt"] == [20]


def test_a_payload_that_verifies_but_does_not_load_stops_the_run(store: FsspecStore) -> None:
    save(store, 10)
    plant_snapshot(store, 20, {"step": 20, "extras": {"data_dir": pathlib.Path("/data")}})
    with capture_logs() as logs, pytest.raises(SnapshotUnloadable) as info:
        load_newest(store, SINGLE)
    message = str(info.value)
    assert "pathlib.PosixPath" in message and "step_000000000020" in message
    assert "fix:" in message and "\n" not in message
    assert info.value.exit_code == EXIT_FATAL == 78
    events = [e["event"] for e in logs]
    assert "snapshot.corrupt" not in events and "snapshot.discovered" not in events
    assert list_snapshot_dirs(store) == [20, 10]


def test_an_unloadable_payload_with_a_wrong_checksum_is_corruption(store: FsspecStore) -> None:
    save(store, 10)
    plant_snapshot(store, 20, {"p": pathlib.Path("/data")})
    path = payload_path(store, 20)
    data = bytearray(store.read_bytes(path))
    data[len(data) // 2] ^= 0x01
    store.write_bytes(path, bytes(data))
    loaded = load_newest(store, SINGLE)
    assert loaded is not None and loaded.step == 10
