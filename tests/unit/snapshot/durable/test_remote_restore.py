"""Restoring from a remote store (an object store; ``memory://`` here): the payload is
read with a few large reads into a local temporary file, checked there and loaded
with ``torch.load(mmap=True)``. When that file cannot be made (no room in ``TMPDIR``)
restore says so and streams instead; a payload changed after its commit is corrupt
either way."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotCorrupt
from elastictrain.snapshot.format.reader import read_manifest, verify_snapshot
from elastictrain.storage import FsspecStore, open_store
from tests.planted import plant_snapshot


@pytest.fixture
def store(request: pytest.FixtureRequest) -> Iterator[FsspecStore]:
    s = open_store(f"memory://remote-restore-{os.getpid()}-{id(request)}")
    yield s
    s.delete("", recursive=True)


def test_a_remote_payload_is_spooled_checked_and_loaded(store: FsspecStore,
                                                        tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    plant_snapshot(store, 3, {"step": 3, "w": torch.arange(1000, dtype=torch.float32)})
    with capture_logs() as logs:
        payload = verify_snapshot(store, 3, load=True).payload
    assert payload is not None and torch.equal(payload["w"], torch.arange(1000.0))
    assert not [e for e in logs if e["event"] == "snapshot.spool_skipped"]
    assert list(tmp_path.iterdir()) == []  # the spool file is gone; the mapping lives on
    assert verify_snapshot(store, 3).payload is None  # a check alone loads nothing


def test_no_room_for_the_spool_file_streams_instead(store: FsspecStore,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    plant_snapshot(store, 3, {"step": 3, "w": torch.ones(100)})
    with capture_logs() as logs:
        payload = verify_snapshot(store, 3, load=True).payload
    assert payload is not None and torch.equal(payload["w"], torch.ones(100))
    skipped = [e for e in logs if e["event"] == "snapshot.spool_skipped"]
    assert len(skipped) == 1 and "TMPDIR" in skipped[0]["fix"]
    assert "No space left" in skipped[0]["error"]


@pytest.mark.parametrize("load", [True, False])
def test_a_payload_changed_after_its_commit_is_corrupt(store: FsspecStore, load: bool) -> None:
    plant_snapshot(store, 3, {"step": 3, "w": torch.ones(100)})
    path = f"{layout.step_dir(3)}/{read_manifest(store, 3).objects[0].name}"
    data = bytearray(store.read_bytes(path))
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    store.write_bytes(path, bytes(data))
    with pytest.raises(SnapshotCorrupt, match=r"crc32 .* != manifest"):
        verify_snapshot(store, 3, load=load)
